"""Draft trees against a chain (scripts/tree_benchmark.py): variant names, the summary against the baseline, the
table and the plot."""
from __future__ import annotations

import json
from pathlib import Path

from ..drafts.tree import DEFAULT_EAGLE_CHOICES


def variant_fields(name: str) -> dict:
    """Eagle3Config fields of a variant name: ``chain:K`` (K drafts), ``static:default`` or ``static:JSON`` (the
    default tree, or eagle_choices), ``dynamic:TOPK:N:DEPTH``. Raises ValueError on anything else."""
    kind, _, rest = name.partition(":")
    if kind == "chain":
        return {"max_draft_len": int(rest)}
    if kind == "static":
        choices = DEFAULT_EAGLE_CHOICES if rest == "default" else json.loads(rest)
        return {"max_draft_len": max(len(c) for c in choices), "eagle_choices": [list(c) for c in choices]}
    if kind == "dynamic":
        top_k, size, depth = (int(x) for x in rest.split(":"))
        return {"max_draft_len": depth, "use_dynamic_tree": True, "dynamic_tree_max_topK": top_k,
                "max_total_draft_tokens": size}
    raise ValueError(f"unknown variant {name!r}: chain:K, static:default|JSON or dynamic:TOPK:N:D")


def summarise(result: dict) -> dict:
    """Each point's step cost against the baseline's at its batch size, its tokens/s at the head's acceptance
    (where given) and that against the baseline's; the fastest such variant per batch size."""
    base = result["points"][0]["variant"]
    by = {(p["variant"], p["batch"]): p for p in result["points"]}
    for p in result["points"]:
        accepted = result["accepted"].get(p["variant"])
        decoding = p["tokens_per_second"] * p["step_ms"] / 1e3 / p["tokens_per_step"]  # requests per step
        p["head_tokens_per_second"] = round(accepted * decoding / (p["step_ms"] / 1e3), 1) if accepted else None
    best: dict[int, str] = {}
    for p in result["points"]:
        ref = by.get((base, p["batch"]))
        p["step_vs_baseline"] = round(p["step_ms"] / ref["step_ms"], 3) if ref else None
        both = ref and p["head_tokens_per_second"] and ref["head_tokens_per_second"]
        p["head_tokens_per_second_vs_baseline"] = round(
            p["head_tokens_per_second"] / ref["head_tokens_per_second"], 3) if both else None
        if p["head_tokens_per_second"] and (p["batch"] not in best or p["head_tokens_per_second"] > by[
                (best[p["batch"]], p["batch"])]["head_tokens_per_second"]):
            best[p["batch"]] = p["variant"]
    result["baseline"] = base
    result["fastest"] = {str(b): v for b, v in sorted(best.items())}
    return result


def table(result: dict) -> str:
    lines = [f"{result['gpu']}, {result['shape']} random weights, bf16, prompt {result['prompt_len']}, "
             f"{result['new_tokens']} new tokens, {'compiled' if result['compiled'] else 'not compiled'}, "
             f"{result['date']}; baseline {result['baseline']}",
             "| variant | verified tokens | batch | step ms | step vs baseline | head's tokens/step | "
             "tok/s at it | vs baseline |", "|---|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        v = result["variants"][p["variant"]]
        accepted = result["accepted"].get(p["variant"])
        ratio = p["head_tokens_per_second_vs_baseline"]
        head = (f"{accepted:.2f} | {p['head_tokens_per_second']:.1f} | "
                f"{f'{ratio:.3f}x' if ratio else '-'}") if accepted else "- | - | -"
        lines.append(f"| {p['variant']} | {v['verified_tokens']} | {p['batch']} | {p['step_ms']:.2f} | "
                     f"{p['step_vs_baseline']:.3f}x | {head} |")
    lines.append(f"fastest at the head's acceptance, per batch size: {result['fastest']}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for batch in sorted({p["batch"] for p in result["points"]}):
        pts = sorted((result["variants"][p["variant"]]["verified_tokens"], p["step_vs_baseline"])
                     for p in result["points"] if p["batch"] == batch)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"batch {batch}")
    ax.axhline(1.15, color="grey", linestyle=":", label="1.15x")
    ax.set_xlabel("tokens verified per request (drafts + 1)")
    ax.set_ylabel(f"step time / {result['baseline']} step")
    ax.set_title(f"{result['shape']} on {result['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
