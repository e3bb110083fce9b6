"""Acceptance evaluation on held-out prompts: for each method (a draft head, the draft LM, suffix drafting, a
head with suffix drafting on top) and temperature, the mean accepted length (bonus token included, with its
standard error over prompts), the acceptance rate per draft position and the histogram of accepted drafts; plus
wall-clock tokens/s with and without speculation on the same engine (batch 1, T = 0). Greedy outputs are
compared with plain decoding's, prompt by prompt (speculation must not change them).

Sampled temperatures are verified by rejection sampling (``use_rejection_sampling=True``: drafts drawn at the
request's temperature, accepted with probability min(1, p/q)); T = 0 by exact argmax comparison. Suffix drafts
(``SAConfig``) are deterministic, so sampled requests verify them strictly, which is exact.

Prompts are the first ``prompt_tokens`` tokens of held-out files. The demo recipe stores the held-out files'
opening text in ``assets/demo/heldout.json`` so the prompts do not depend on the local Python's stdlib.
Generation ignores EOS (every request runs ``max_new_tokens``) so all heads see the same amount of text.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .. import demo
from ..config import (
    DraftTargetConfig,
    Eagle3Config,
    MTPConfig,
    SAConfig,
    SamplingParams,
)
from ..engine.request import GenerationOutputs
from ..spec_model import SpecModel

HELDOUT_FILE = "heldout.json"
SpecConfig = Eagle3Config | MTPConfig | DraftTargetConfig | SAConfig | None


def heldout_texts(path: str | Path | None = None, num_chars: int = 1200) -> list[str]:
    """The stored opening text of each held-out file (``{"prompts": [{"file", "text"}, ...]}``). Default: the
    shipped pair's ``assets/demo/heldout.json``, else the local stdlib's held-out files under the same rule."""
    path = Path(path) if path is not None else demo.ASSETS / HELDOUT_FILE
    if path.is_file():
        return [entry["text"] for entry in json.loads(path.read_text())["prompts"]]
    if path != demo.ASSETS / HELDOUT_FILE:
        raise FileNotFoundError(f"{path}: no such held-out prompt file")
    from ..training.data import split_heldout, stdlib_files

    print(f"no {path}: prompts from this Python's held-out stdlib files (every 10th of the sorted list)")
    return [f.read_text(encoding="utf-8", errors="replace")[:num_chars] for f in split_heldout(stdlib_files())[1]]


def prompt_ids(tokenizer, texts: list[str], num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    """The first ``prompt_tokens`` tokens of the first ``num_prompts`` texts that have that many."""
    prompts = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= prompt_tokens:
            prompts.append(ids[:prompt_tokens])
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError(f"no held-out text has {prompt_tokens} tokens")
    return prompts


def add_head_arguments(parser) -> None:
    """The target and head flags of the acceptance scripts (a path, a ``demo://`` name, or 'none': :func:`given`)."""
    parser.add_argument("--target", default="demo://target")
    parser.add_argument("--eagle3", default="demo://eagle3", help="EAGLE-3 head directory, or 'none'")
    parser.add_argument("--mtp", default="demo://mtp", help="MTP weights directory, 'target' (inside the target "
                        "checkpoint) or 'none'")


def given(path: str) -> str | None:
    """A head flag's value: None for 'none'."""
    return None if path == "none" else path


def head_configs(eagle3: str | None, mtp: str | None, k: int, tree: list[list[int]] | None = None,
                 dynamic_tree: tuple[int, int, int] | None = None, draft: str | None = None, sa_k: int = 0,
                 sa_spec_threshold: int = 0) -> dict[str, SpecConfig]:
    """Named speculative configs to evaluate; ``mtp == "target"`` reads MTP weights from the target dir. Sampled
    requests (T > 0) are verified by rejection sampling; greedy ones by exact argmax comparison either way. With
    ``tree`` (eagle_choices) also the EAGLE-3 head drafting that static tree ("eagle3-tree"; sampled requests'
    children drawn without replacement and verified by recursive rejection sampling); with ``dynamic_tree``
    (top-k, drafts, depth) the head growing a dynamic tree ("eagle3-dynamic-tree"). ``draft``: a draft LM
    drafting K ("draft_target"); ``sa_k`` > 0: suffix drafting of that K ("sa"); ``sa_spec_threshold`` > 0:
    each head with the suffix automaton's drafts where the text repeats ("eagle3+sa", "mtp+sa")."""
    heads: dict[str, SpecConfig] = {}
    if eagle3:
        heads["eagle3"] = Eagle3Config(speculative_model=eagle3, max_draft_len=k, use_rejection_sampling=True)
    if eagle3 and tree:
        heads["eagle3-tree"] = Eagle3Config(speculative_model=eagle3, max_draft_len=max(len(c) for c in tree),
                                            eagle_choices=tree, use_rejection_sampling=True)
    if eagle3 and dynamic_tree:
        top_k, size, depth = dynamic_tree
        heads["eagle3-dynamic-tree"] = Eagle3Config(
            speculative_model=eagle3, max_draft_len=depth, use_dynamic_tree=True, dynamic_tree_max_topK=top_k,
            max_total_draft_tokens=size, use_rejection_sampling=True)
    if mtp:
        heads["mtp"] = MTPConfig(num_nextn_predict_layers=1, max_draft_len=k, use_rejection_sampling=True,
                                 mtp_checkpoint=None if mtp == "target" else mtp)
    if draft:
        heads["draft_target"] = DraftTargetConfig(speculative_model=draft, max_draft_len=k,
                                                  use_rejection_sampling=True)
    if sa_k:
        heads["sa"] = SAConfig(max_draft_len=sa_k)
    if sa_spec_threshold:
        enhancer = {"use_sa_spec": True, "sa_spec_threshold": sa_spec_threshold}
        heads |= {f"{name}+sa": type(heads[name]).model_validate(heads[name].model_dump() | enhancer)
                  for name in ("eagle3", "mtp") if name in heads}
    return heads


def load(target: str, spec: SpecConfig, device: str, dtype: str | None, max_seq_len: int,
         quantization: str | None = None) -> SpecModel:
    return SpecModel.from_pretrained(target, spec, dtype=dtype, device=device, quantization=quantization,
                                     max_batch_size=1, max_seq_len=max_seq_len)


def acceptance(model: SpecModel, prompts: list[list[int]], max_new_tokens: int, temperature: float,
               seed: int = 0) -> dict[str, object]:
    """Aggregate acceptance statistics of one generate() over ``prompts``."""
    return acceptance_stats(generate(model, prompts, max_new_tokens, temperature, seed))


def generate(model: SpecModel, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0) -> GenerationOutputs:
    """Every prompt continued by exactly ``max_new_tokens`` tokens (EOS ignored)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=True)
    return model.generate(prompts, params, seed=seed)


def acceptance_stats(outputs: GenerationOutputs) -> dict[str, object]:
    """Steps, tokens, mean accepted length (± its standard error over prompts), rate per position, histogram."""
    keys = ("steps", "num_tokens", "mean_accepted_length", "acceptance_rate_per_position", "histogram")
    stats = {key: outputs.stats[key] for key in keys}
    per_prompt = [(sum(o.stats.accepted_per_step), o.stats.num_steps) for o in outputs]
    stats["mean_accepted_length_se"] = round(ratio_standard_error(per_prompt), 4)
    return stats


def ratio_standard_error(per_prompt: list[tuple[int, int]]) -> float:
    """Standard error of the mean accepted length sum(tokens) / sum(steps) over prompts [(tokens, steps)]:
    the ratio estimator's (delta method), prompts being the independent units (a prompt's steps are not: one
    hard passage lowers many). 0 for fewer than 2 prompts."""
    m = len(per_prompt)
    steps = sum(s for _, s in per_prompt)
    if m < 2 or steps == 0:
        return 0.0
    ratio = sum(n for n, _ in per_prompt) / steps
    residuals = sum((n - ratio * s) ** 2 for n, s in per_prompt)
    return (m / (m - 1) * residuals) ** 0.5 / steps


def throughput(models: dict[str, SpecModel], prompts: list[list[int]], max_new_tokens: int, repeats: int = 3
               ) -> dict[str, dict[str, float]]:
    """Per model its median run of ``repeats`` (wall-clock tokens/s with prefill, decode-only tokens/s, step ms),
    greedy, batch 1. The models take turns in every repeat, so background load hits them alike, and each one's
    ``speedup`` is the median over repeats of its tokens/s over plain's in the same repeat (an in-run ratio;
    needs a model named "plain")."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in models}
    for model in models.values():
        model.generate([prompts[0]], SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            stats = model.generate(prompts, params).stats
            seconds = time.perf_counter() - start
            decode_tokens = stats["mean_accepted_length"] * stats["decode_steps"]
            runs[name].append({"tokens_per_s": stats["num_tokens"] / seconds, "seconds": seconds,
                               "decode_tokens_per_s": decode_tokens / max(stats["decode_seconds"], 1e-9),
                               "step_ms": stats["step_ms"]})
    result = {}
    for name, rs in runs.items():
        result[name] = {k: round(v, 3) for k, v in _median_run(rs).items()}
        if name != "plain" and "plain" in runs:
            result[name]["speedup"] = round(_median_ratio(rs, runs["plain"]), 3)
    return result


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run of median tokens/s (the upper one of an even count)."""
    return _upper_median(runs, key=lambda r: r["tokens_per_s"])


def _median_ratio(runs: list[dict[str, float]], baseline: list[dict[str, float]]) -> float:
    """The median over repeats of tokens/s over the baseline's in the same repeat (the upper one of an even
    count)."""
    return _upper_median([r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, baseline, strict=True)])


def _upper_median(values: list, key=None):
    """The median of ``values`` (by ``key``), the upper one of an even count."""
    return sorted(values, key=key)[len(values) // 2]


def evaluate(target: str, heads: dict[str, SpecConfig], prompts: list[list[int]], max_new_tokens: int,
             temperatures: tuple[float, ...] = (0.0, 1.0), device: str = "cpu", dtype: str | None = None,
             speed_prompts: int = 4, repeats: int = 3, progress: bool = True, label: str = "",
             quantization: str | None = None) -> dict[str, object]:
    """Acceptance per method and temperature, then the speed comparison; one JSON-ready dict. At T = 0 each
    method's outputs are compared with plain greedy decoding's (``prompts_matching_plain``). ``prompt_tokens``:
    the prompts' mean length (their common one for equal prompts). ``quantization="fp8"``: the target (plain and
    under every method) quantized at load; the drafts keep their precision. The models are closed on return."""
    max_seq_len = max(len(p) for p in prompts) + max_new_tokens + 16
    models = {"plain": load(target, None, device, dtype, max_seq_len, quantization)}
    models |= {name: load(target, spec, device, dtype, max_seq_len, quantization) for name, spec in heads.items()}
    result: dict[str, object] = {"target": target, "device": device, "quantization": quantization,
                                 "num_prompts": len(prompts),
                                 "prompt_tokens": round(sum(map(len, prompts)) / len(prompts)),
                                 "max_new_tokens": max_new_tokens, "heads": {}, "threads": torch.get_num_threads(),
                                 "engine_threads": models["plain"].loop.call(torch.get_num_threads)}
    plain_ids = [o.token_ids for o in generate(models["plain"], prompts, max_new_tokens)] if 0.0 in temperatures \
        else None
    for name, spec in heads.items():
        result["heads"][name] = {"config": spec.model_dump(mode="json"), "max_draft_len": models[name].max_draft_len}
        for temperature in temperatures:
            outputs = generate(models[name], prompts, max_new_tokens, temperature)
            stats = result["heads"][name][f"T={temperature:g}"] = acceptance_stats(outputs)
            if temperature == 0.0:
                stats["prompts_matching_plain"] = sum(o.token_ids == ids for o, ids in zip(outputs, plain_ids))
            if progress:
                print(f"{label}{name} T={temperature:g}: mean accepted length {stats['mean_accepted_length']:.3f} "
                      f"± {stats['mean_accepted_length_se']:.3f} (standard error over prompts), "
                      f"per position {stats['acceptance_rate_per_position']}, histogram {stats['histogram']}",
                      flush=True)
    result["speed"] = {}
    if speed_prompts > 0:  # 0: acceptance only
        result["speed"] = throughput(models, prompts[:speed_prompts], max_new_tokens, repeats)
    for model in models.values():
        model.close()
    return result


def format_table(result: dict[str, object]) -> str:
    """A markdown table of one workload's evaluation: a row per method and temperature."""
    lines = [("| head | T | mean accepted length (± s.e.) | acceptance per position | histogram | tokens/s (speedup) "
              "| greedy = plain (prompts) |"), "|---|---|---|---|---|---|---|"]
    speed = result["speed"]
    if speed:
        lines.append(f"| none (plain) | 0 | 1.00 | - | - | {speed['plain']['tokens_per_s']:.1f} | - |")
    for name, head in result["heads"].items():
        for key, stats in head.items():
            if not key.startswith("T="):
                continue
            timed = speed and key == "T=0"
            tps = f"{speed[name]['tokens_per_s']:.1f} ({speed[name]['speedup']:.2f}x)" if timed else "-"
            rates = ", ".join(f"{r:.2f}" for r in stats["acceptance_rate_per_position"])
            se = stats.get("mean_accepted_length_se")  # absent from evaluations written before it was added
            length = f"{stats['mean_accepted_length']:.2f}" + (f" ± {se:.2f}" if se is not None else "")
            matching = stats.get("prompts_matching_plain")  # T = 0 only, and not in older evaluations
            lossless = "-" if matching is None else f"{matching}/{result['num_prompts']}"
            lines.append(f"| {name} | {key[2:]} | {length} | {rates} | {stats['histogram']} | {tps} | {lossless} |")
    return "\n".join(lines)
