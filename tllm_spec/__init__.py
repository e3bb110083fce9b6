"""tllm_spec: TensorRT-LLM-style one-model speculative decoding (EAGLE-3, MTP) for Hugging Face causal LMs."""
from .caches import configure_caches

configure_caches()  # TLLM_SPEC_CACHE_DIR: before anything compiles

from .config import (
                     Eagle3Config,
                     EngineConfig,
                     GuidedDecodingParams,
                     MTPConfig,
                     RunConfig,
                     SamplingParams,
                     load_run_config,
)
from .drafts import SpecMetadata, SpecWorkerBase
from .engine.request import AcceptanceStats, GenerationOutputs, RequestOutput
from .modes import SpeculativeDecodingMode
from .spec_model import SpecModel

__all__ = [
    "AcceptanceStats",
    "GenerationOutputs",
    "RequestOutput",
    "SpecModel",
    "Eagle3Config",
    "EngineConfig",
    "GuidedDecodingParams",
    "MTPConfig",
    "RunConfig",
    "SamplingParams",
    "SpecMetadata",
    "SpecWorkerBase",
    "SpeculativeDecodingMode",
    "load_run_config",
]
