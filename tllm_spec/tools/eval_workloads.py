"""The acceptance evaluation over prompt workloads: every method of :func:`.acceptance_eval.head_configs` on each
workload, one JSON-ready result, its markdown report and its plot.

Workloads: ``first-line``, the first ``prompt_tokens`` tokens of held-out files (free continuation); ``edit``,
:func:`.workloads.edit_prompts` (a function quoted, then asked for back with a parameter renamed: most of the
answer repeats the prompt, where suffix drafting and a draft LM copying the context shine).

The result holds each workload's evaluation (as :func:`.acceptance_eval.evaluate` returns it) under
``workloads``; its top level is the first-line evaluation's (``heads``, ``speed``, ``num_prompts``,
``prompt_tokens``, ...), the layout written before workloads existed, so its readers keep working.
"""
from __future__ import annotations

from pathlib import Path

from .acceptance_eval import SpecConfig, evaluate, format_table, prompt_ids
from .workloads import edit_prompts

WORKLOADS = ("first-line", "edit")
COMMON_KEYS = ("target", "device", "max_new_tokens", "threads", "engine_threads")


def workload_prompts(names: list[str], tokenizer, texts: list[str], num_prompts: int, prompt_tokens: int,
                     edit_max_chars: int = 1000) -> dict[str, list[list[int]]]:
    """Token ids of each named workload's ``num_prompts`` prompts: first-line from ``texts`` (each cut to
    ``prompt_tokens``), edit from the demo's held-out files (each prompt whole, at most ``edit_max_chars``)."""
    build = {"first-line": lambda: prompt_ids(tokenizer, texts, num_prompts, prompt_tokens),
             "edit": lambda: [tokenizer.encode(text, add_special_tokens=False)
                              for text in edit_prompts(num_prompts, edit_max_chars)]}
    return {name: build[name]() for name in names}


def evaluate_workloads(target: str, heads: dict[str, SpecConfig], prompts: dict[str, list[list[int]]],
                       max_new_tokens: int, **options) -> dict[str, object]:
    """:func:`.acceptance_eval.evaluate` on each workload's prompts (``options`` passed on), assembled as the
    module docstring says."""
    per_workload = {name: evaluate(target, heads, ids, max_new_tokens, label=f"{name}: ", **options)
                    for name, ids in prompts.items()}
    first = next(iter(per_workload.values()))
    return {**{key: first[key] for key in COMMON_KEYS}, **per_workload.get("first-line", {}),
            "workloads": per_workload}


def format_report(result: dict[str, object]) -> str:
    """Markdown: the summary table, then each workload's full table."""
    sections = ["## Summary (mean accepted length per step; tokens/s vs plain at batch 1, T = 0)", "",
                summary_table(result)]
    for name, entry in result["workloads"].items():
        title = (f"## {name}: {entry['num_prompts']} prompts of {entry['prompt_tokens']} tokens (mean), "
                 f"{entry['max_new_tokens']} new tokens each")
        sections += ["", title, "", format_table(entry)]
    return "\n".join(sections)


def summary_table(result: dict[str, object]) -> str:
    """One row per method; per workload, the mean accepted length at each temperature and the T=0 speedup."""
    workloads = result["workloads"]
    columns = [(name, key) for name, entry in workloads.items() for key in (*_temperature_keys(entry), "speedup")]
    lines = ["| method | " + " | ".join(f"{name} {key}" for name, key in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for method in ["plain", *methods(result)]:
        cells = [_cell(workloads[name], method, key) for name, key in columns]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def methods(result: dict[str, object]) -> list[str]:
    """Every method evaluated on any workload, in evaluation order."""
    return list(dict.fromkeys(m for entry in result["workloads"].values() for m in entry["heads"]))


def _temperature_keys(entry: dict[str, object]) -> list[str]:
    return list(dict.fromkeys(key for head in entry["heads"].values() for key in head if key.startswith("T=")))


def _cell(entry: dict[str, object], method: str, key: str) -> str:
    """A summary cell: ``3.58`` (mean accepted length), ``1.85x`` (speedup), plain's ``1.00`` / tokens/s."""
    speed = entry["speed"].get(method)
    if key == "speedup":
        if speed is None:
            return "-"
        return f"{speed['tokens_per_s']:.1f} tok/s" if method == "plain" else f"{speed['speedup']:.2f}x"
    if method == "plain":
        return "1.00"
    stats = entry["heads"].get(method, {}).get(key)
    return "-" if stats is None else f"{stats['mean_accepted_length']:.2f}"


def plot(result: dict[str, object], path: str | Path) -> Path | None:
    """Grouped bars per method: the mean accepted length per workload and temperature, and the T = 0 speedup per
    workload; None (with a message) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: plot skipped (pip install matplotlib)")
        return None
    names, workloads = methods(result), result["workloads"]
    lengths = {f"{w} {key}": [_length(entry, m, key) for m in names]
               for w, entry in workloads.items() for key in _temperature_keys(entry)}
    speedups = {w: [entry["speed"][m]["speedup"] if m in entry["speed"] else 0.0 for m in names]
                for w, entry in workloads.items() if entry["speed"]}
    fig, (ax_length, ax_speed) = plt.subplots(1, 2, figsize=(15, 4.5))
    _grouped_bars(ax_length, names, lengths)
    ax_length.set(title="mean accepted tokens per step", ylabel="tokens per step")
    _grouped_bars(ax_speed, names, speedups)
    ax_speed.axhline(1.0, color="black", linewidth=0.8)
    ax_speed.set(title=f"tokens/s vs plain, batch 1, T=0 ({result['device']})", ylabel="speedup")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def _length(entry: dict[str, object], method: str, key: str) -> float:
    stats = entry["heads"].get(method, {}).get(key)
    return 0.0 if stats is None else stats["mean_accepted_length"]


def _grouped_bars(ax, names: list[str], series: dict[str, list[float]]) -> None:
    """One group of bars per name, one bar per series (labelled in the legend)."""
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x - 0.4 + (i + 0.5) * width for x in range(len(names))], values, width, label=label)
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.legend(fontsize="small")
