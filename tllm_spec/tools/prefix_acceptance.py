"""Acceptance with the prefix cache cold and warm (engine/prefix_cache.py), per drafter, on one engine: the
prompts with the cache off (cold: each prefilled from its first token), then twice with it on, the second pass
(warm) reusing what the first cached (:func:`cold_warm`). Outputs must be identical and the mean accepted length
must not fall: a draft that attended over a stale or missing prefix K/V keeps greedy outputs right and loses
acceptance. Two prompt sets: ``repeat`` (each prompt again: a whole-prompt hit) and ``shared`` (one long shared
prefix, then each prompt's own text, as a system prompt before different questions).

Greedy requests, and sampled ones each with its own seed (``SamplingParams.seed``: the same draws however the
batch and the prefill steps differ between the passes)."""
from __future__ import annotations

from ..config import SamplingParams
from ..engine.request import GenerationOutputs
from ..spec_model import SpecModel
from .acceptance_eval import SpecConfig


def shared_prefix_prompts(prompts: list[list[int]], prefix_tokens: int) -> list[list[int]]:
    """The first prompt's first ``prefix_tokens`` tokens (repeated to that length) before each other prompt."""
    head = (prompts[0] * (prefix_tokens // len(prompts[0]) + 1))[:prefix_tokens]
    return [head + p for p in prompts[1:]]


def cold_warm(model: SpecModel, prompts: list[list[int]], max_new_tokens: int, temperature: float
              ) -> dict[str, object]:
    """``prompts`` with the cache off (cold: every prompt prefilled from its first token), then once with it on
    to fill it, then again (warm: every prompt reuses what the pass before cached): mean accepted length of the
    cold and warm passes, outputs identical, cached prompt tokens."""
    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    cache = model.engine.prefix_cache
    model.loop.call(lambda: (cache.reset(), setattr(cache, "enabled", False)))
    cold = model.generate(prompts, params)
    model.loop.call(lambda: setattr(cache, "enabled", True))
    model.generate(prompts, params)
    warm = model.generate(prompts, params)
    return {"cold_mean_accepted_length": _mean_accepted(cold), "warm_mean_accepted_length": _mean_accepted(warm),
            "outputs_identical": sum(a.token_ids == b.token_ids for a, b in zip(cold, warm)),
            "num_prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "warm_cached_tokens": sum(o.stats.cached_prompt_tokens for o in warm)}


def _mean_accepted(outputs: GenerationOutputs) -> float:
    return round(float(outputs.stats["mean_accepted_length"]), 4)


def evaluate(target: str, heads: dict[str, SpecConfig], prompts: list[list[int]], max_new_tokens: int,
             prefix_tokens: int, temperatures: tuple[float, ...] = (0.0, 1.0), device: str = "cpu",
             dtype: str | None = None, page_size: int = 16) -> dict[str, object]:
    """Per head, temperature and prompt set (``repeat``, ``shared``): :func:`cold_warm`. Batch 1 (each prompt's
    pages are cached before the next one arrives), a pool large enough that nothing cached is evicted."""
    sets = {"repeat": prompts, "shared": shared_prefix_prompts(prompts, prefix_tokens)}
    max_seq_len = max(len(p) for p in sets["shared"] + prompts) + max_new_tokens + 16
    # a pool that holds every prompt's pages besides the running request's: nothing cached is evicted
    num_pages = sum(-(-len(p) // page_size) for ps in sets.values() for p in ps) + 2 * max_seq_len // page_size + 8
    result: dict[str, object] = {"target": target, "device": device, "page_size": page_size,
                                 "prefix_tokens": prefix_tokens, "max_new_tokens": max_new_tokens, "heads": {}}
    for name, spec in heads.items():
        with SpecModel.from_pretrained(target, spec, dtype=dtype, device=device, max_batch_size=1,
                                       max_seq_len=max_seq_len, page_size=page_size, num_pages=num_pages,
                                       enable_prefix_caching=True) as model:
            result["heads"][name] = {f"{kind} T={t:g}": cold_warm(model, ps, max_new_tokens, t)
                                     for kind, ps in sets.items() for t in temperatures}
    return result


def format_table(result: dict[str, object]) -> str:
    rows = ["| drafter | prompts | cold AL (cache off) | warm AL | warm - cold | identical | warm cached tokens |",
            "|---|---|---|---|---|---|---|"]
    for name, runs in result["heads"].items():
        for run_name, r in runs.items():
            delta = r["warm_mean_accepted_length"] - r["cold_mean_accepted_length"]
            rows.append(f"| {name} | {run_name} | {r['cold_mean_accepted_length']:.3f} | "
                        f"{r['warm_mean_accepted_length']:.3f} | {delta:+.3f} | "
                        f"{r['outputs_identical']}/{r['num_prompts']} | "
                        f"{r['warm_cached_tokens']} of {r['prompt_tokens']} |")
    return "\n".join(rows)
