"""tllm_spec: TensorRT-LLM-style one-model speculative decoding (EAGLE-3, MTP, a draft LM,
suffix-automaton drafting) for Hugging Face causal LMs.

The names below load on first use (PEP 562): ``import tllm_spec`` alone, or a light submodule (the serving
benchmark's client, the cache settings), does not import torch, Dynamo or transformers."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .caches import configure_caches

configure_caches()  # TLLM_SPEC_CACHE_DIR: before anything compiles

_EXPORTS = {
    "AcceptanceStats": ".engine.request",
    "GenerationOutputs": ".engine.request",
    "RequestOutput": ".engine.request",
    "SpecModel": ".spec_model",
    "DraftTargetConfig": ".config",
    "Eagle3Config": ".config",
    "EngineConfig": ".config",
    "GuidedDecodingParams": ".config",
    "MTPConfig": ".config",
    "RunConfig": ".config",
    "SAConfig": ".config",
    "SamplingParams": ".config",
    "load_run_config": ".config",
    "SpecMetadata": ".drafts",
    "SpecWorkerBase": ".drafts",
    "SpeculativeDecodingMode": ".modes",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from .config import (
                         DraftTargetConfig,
                         Eagle3Config,
                         EngineConfig,
                         GuidedDecodingParams,
                         MTPConfig,
                         RunConfig,
                         SAConfig,
                         SamplingParams,
                         load_run_config,
    )
    from .drafts import SpecMetadata, SpecWorkerBase
    from .engine.request import AcceptanceStats, GenerationOutputs, RequestOutput
    from .modes import SpeculativeDecodingMode
    from .spec_model import SpecModel


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
