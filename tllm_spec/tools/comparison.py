"""Speculative decoding against plain decoding of the same prompts on the same engine settings: what
``scripts/generate.py`` shows by default."""
from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import RunConfig, SamplingParams
from ..engine.request import GenerationOutputs
from ..spec_model import SpecModel


@dataclass(frozen=True)
class Comparison:
    spec: GenerationOutputs  # the speculative run (its outputs and stats)
    plain: GenerationOutputs  # the same prompts decoded without speculation
    same_tokens: bool  # every request produced the same token ids in both runs (guaranteed greedy, lossless)

    @property
    def speedup(self) -> float:
        """Speculative over plain tokens/s (wall time of each whole generate call, prefill included)."""
        return self.spec.stats["tokens_per_second"] / max(self.plain.stats["tokens_per_second"], 1e-9)


def timed_generate(model: SpecModel, prompts: Sequence[str | list[int]], params: SamplingParams, seed: int = 0,
                   progress: bool = False) -> GenerationOutputs:
    """``model.generate`` after a short untimed warm-up (first-call allocations and lazy initialisation)."""
    model.generate(list(prompts[:1]), params.model_copy(update={"max_new_tokens": min(8, params.max_new_tokens)}),
                   seed=seed)
    return model.generate(list(prompts), params, seed=seed, progress=progress)


def compare(cfg: RunConfig, prompts: Sequence[str | list[int]], seed: int = 0, progress: bool = False
            ) -> Comparison:
    """Decode ``prompts`` with ``cfg`` (which must be speculative), then with ``cfg`` minus its spec_config.
    One model is in memory at a time: the speculative one is freed before the plain one loads."""
    if cfg.spec_config is None:
        raise ValueError("compare() needs a speculative run config (spec_config is None)")
    spec = timed_generate(SpecModel.from_run_config(cfg), prompts, cfg.sampling, seed, progress)
    _release()
    plain_cfg = cfg.model_copy(update={"spec_config": None, "draft_quantization": None})  # no draft to quantize
    plain = timed_generate(SpecModel.from_run_config(plain_cfg), prompts, cfg.sampling, seed, progress)
    _release()
    same = all(a.token_ids == b.token_ids for a, b in zip(spec, plain))
    return Comparison(spec, plain, same)


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
