"""tllm_spec: TensorRT-LLM-style one-model speculative decoding (EAGLE-3, MTP) for Hugging Face causal LMs."""
from .config import (EngineConfig, Eagle3Config, GuidedDecodingParams, MTPConfig, RunConfig, SamplingParams,
                     load_run_config)
from .metadata import SpecMetadata
from .engine import GenerationOutputs
from .modes import SpeculativeDecodingMode
from .request import AcceptanceStats, RequestOutput
from .spec_model import SpecModel
from .workers import SpecWorkerBase

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
