"""Typed, frozen configuration: sampling, guided decoding, engine, and YAML run files (the speculative configs
live in spec_config.py and are re-exported here)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from .spec_config import (  # noqa: F401  (the speculative configs, re-exported: users import them from here)
    DraftTargetConfig,
    Eagle3Config,
    FrozenConfig,
    MTPConfig,
    SAConfig,
    SpecConfig,
)

# A temperature below this is greedy (TensorRT-LLM's sentinel for "temperature disabled" is ~1e-5).
GREEDY_TEMPERATURE = 1e-4


_Frozen = FrozenConfig


class GuidedDecodingParams(_Frozen):
    """A grammar the output must follow: exactly one of a JSON schema, a regular expression or a Lark grammar
    (TensorRT-LLM's ``GuidedDecodingParams`` kinds). Compiled per request when it is admitted: a grammar the
    backend refuses rejects that request only."""

    json_schema: str | None = Field(None, description="JSON schema (a dict or its JSON text; stored as JSON text, "
                                    "key order kept: it orders the properties); the output is one JSON value "
                                    "valid under it")
    regex: str | None = Field(None, description="the output matches this regular expression")
    lark: str | None = Field(None, description="the output is a sentence of this Lark grammar")
    json_whitespace_flexible: bool = Field(False, description="json_schema: allow any whitespace between JSON "
                                           "tokens (default: compact separators, which small models cannot loop in "
                                           "and whose forced tokens are drafted exactly)")

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_text(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"json_schema is not valid JSON ({err})") from None
        if value is not None and not isinstance(value, (dict, bool)):
            raise ValueError(f"json_schema must be a JSON object (or true/false), got {type(value).__name__}")
        return None if value is None else json.dumps(value)

    @model_validator(mode="after")
    def _check(self) -> GuidedDecodingParams:
        given = [name for name in ("json_schema", "regex", "lark") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json_schema, regex, lark; got {given or 'none'}")
        return self


class SamplingParams(_Frozen):
    """Per-request sampling. ``temperature == 0`` or ``top_k == 1`` is greedy; ``top_k == 0`` and
    ``top_p == 1`` disable those filters."""

    max_new_tokens: int = Field(64, ge=1, description="most tokens to generate")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="softmax temperature; 0 = greedy")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = no limit")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass kept; 1 = no limit")
    stop_token_ids: tuple[int, ...] = Field((), description="extra token ids that end the request (kept in the output)")
    stop: tuple[str, ...] = Field((), description="strings that end the request; the text is cut before the first "
                                  "one and the tokens after the one that completed it are dropped (needs a tokenizer)")
    ignore_eos: bool = Field(False, description="do not stop at the tokenizer's EOS")
    seed: int | None = Field(None, ge=0, lt=2**63, description="this request's own random stream: the same request "
                             "with the same seed samples the same tokens whatever else is in the batch; None = "
                             "the generate call's stream")
    guided_decoding: GuidedDecodingParams | None = Field(
        None, description="constrain the output to a grammar (needs the target's tokenizer and the 'guided' extra); "
        "the request ends when the grammar is complete")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="None = off; N: each output token's logprob and the N most likely tokens "
        "(RequestOutput.logprobs / top_logprobs), from the target's raw log_softmax(logits) in fp32 at the row "
        "that produced the token: before temperature / top-k / top-p (vLLM's raw logprobs), after a grammar's "
        "mask; the same with and without speculation")
    cache_salt: str | None = Field(None, max_length=1024, description="prefix caching: requests share cached "
                                   "prompt pages only with requests of the same salt (tenant isolation, as vLLM's "
                                   "cache_salt); None: the unsalted cache")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


ADMISSION_WINDOW_CAP = 20  # an idle engine waits at most this many admission windows for a burst to end


class EngineConfig(_Frozen):
    """Capacity of the decoding engine."""

    max_batch_size: int = Field(8, ge=1, le=1024, description="requests decoded together")
    max_seq_len: int | None = Field(None, ge=8, description="prompt + generated tokens; default from the target")
    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV-cache page")
    num_pages: int | None = Field(None, ge=1, description="KV pages in the pool; default: enough for "
                                  "max_batch_size full sequences (CPU) or kv_cache_fraction of free memory (GPU)")
    kv_cache_fraction: float = Field(0.5, gt=0.0, lt=1.0, description="GPU free memory given to the KV pool")
    kv_cache_dtype: Literal["auto", "fp8"] = Field("auto", description="the KV pool's element type: 'auto' the "
                                                  "target's dtype; 'fp8' E4M3 (twice the tokens in the same "
                                                  "memory, half the KV bytes a long-context step reads), with "
                                                  "the checkpoint's per-layer k_scale/v_scale, else 1.0")
    max_num_batched_tokens: int = Field(16384, ge=1, description="prompt tokens a step prefills (chunked "
                                        "prefill): longer prompts enter over several steps, FIFO, while running "
                                        "requests keep decoding in the same steps; bounds prefill memory. 16384: "
                                        "a 32k prompt prefills at 25.1k tokens/s on an H200 with the 8B shape "
                                        "(24.3k in chunks of 8192) and a 128k one peaks at 35.2 GiB (34.1); the "
                                        "server takes 8192, so a long prompt stalls the streams for half as long")
    scheduler_delay_factor: float = Field(0.5, ge=0.0, le=100.0, description="while requests are decoding, "
                                          "a waiting request joins once the oldest waiting one has waited this "
                                          "many times the last prefill step's duration, or as soon as the "
                                          "waiting requests fill the free slots: arrivals close together share "
                                          "one prefill step (a step with prompt tokens runs without a CUDA "
                                          "graph, so each one costs the running streams); 0: admit at once")
    admission_window_ms: float = Field(3.0, ge=0.0, le=1000.0, description="when nothing is decoding, waiting "
                                       "requests start once none has arrived for this long (and at most "
                                       f"{ADMISSION_WINDOW_CAP}x this after the first): a burst of arrivals shares "
                                       "one prefill step; 0: start at once")
    enable_prefix_caching: bool | None = Field(
        None, description="share the K/V of prompt pages another request already prefilled (engine/prefix_cache.py): "
        "a long shared prefix (system prompt, conversation so far) is prefilled once. None: on for a GPU, off for "
        "the CPU, where the engine is the reference the tests compare against: there each prompt is computed from "
        "its first token unless asked, so an output never depends on which requests ran before it")
    enforce_eager: bool = Field(False, description="never capture CUDA graphs (debugging)")
    use_fused_layers: bool = Field(True, description="run supported targets (Llama, Qwen2, Qwen3, Mistral; the "
                                   "MoE families Qwen3-MoE, Mixtral, GLM-4.5), EAGLE-3 heads and MTP modules "
                                   "through tllm_spec's layers with fused q/k/v and gate/up GEMMs and fused experts; "
                                   "False: the stock HF modules (for MoE targets only with enforce_eager)")
    compile_step: Literal["auto"] | bool = Field("auto", description="CUDA: torch.compile the step each CUDA "
                                                 "graph captures: whole (acceptance, sampling, draft passes; the "
                                                 "decoder layers one compiled layer each) on a fused single-GPU "
                                                 "target, else the decoder (stock layers one by one) and the "
                                                 "EAGLE-3 head's passes. 'auto': where it pays, a target of at "
                                                 "least COMPILE_MIN_WEIGHT_BYTES of weights per GPU "
                                                 "(engine/cuda_graphs.py, with the measurements behind it); "
                                                 "smaller ones capture the eager step, which starts in seconds. "
                                                 "Ignored on CPU and with enforce_eager")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs (ranks) the target is split over; "
                                      "launch with torchrun --nproc-per-node N (gloo on CPU); the draft as "
                                      "tp_draft says")
    tp_all_reduce: Literal["auto", "one_shot", "nccl"] = Field(
        "auto", description="tensor parallel on GPUs: 'auto' sums a decoding step's rows with tllm_spec's Lamport "
        "kernel over peer-to-peer symmetric memory, with the residual add and the next RMSNorm in it "
        "(distributed/lamport.py), other inputs up to 512 KB with torch's one-shot kernel, larger ones through "
        "NCCL, each where torch and the GPUs allow it; 'one_shot': torch's one-shot kernel up to 512 KB, "
        "NCCL above; 'nccl': every all-reduce through NCCL")
    tp_draft: Literal["auto", "replicated", "sharded"] = Field(
        "auto", description="tensor parallel: an EAGLE-3 head split like the target ('sharded': its attention "
        "heads, MLP units and draft vocabulary; its fc, norms and embedding whole), which reads a rank's share of "
        "the head's bytes a step for 3 small collectives a pass, or whole on every rank ('replicated'); 'auto' "
        "splits a head that can be split (not an FP8 head, heads and units divisible by the ranks) and keeps "
        "any other whole; MTP modules and draft LMs are always replicated")

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.tensor_parallel_size > 1 and not self.use_fused_layers:
            raise ValueError("tensor_parallel_size > 1 needs use_fused_layers=True (the sharded layers are the "
                             "fused ones)")
        return self


DEMO_TARGET, DEMO_MTP = "demo://target", "demo://mtp"


class RunConfig(_Frozen):
    """A YAML run file: target, speculative config, sampling, engine."""

    target_model: str | None = Field(None, description="HF causal-LM directory; None = the embedded demo target")
    spec_config: SpecConfig | None = Field(None, description="eagle3 / mtp / draft_target / sa; None = plain "
                                           "decoding (MTP on the demo target without mtp_checkpoint reads the "
                                           "demo's module, demo://mtp)")
    sampling: SamplingParams = SamplingParams()
    engine: EngineConfig = EngineConfig()
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    device: str = Field("auto", description="'cpu', 'cuda', 'cuda:1' or 'auto'")
    quantization: Literal["fp8"] | None = Field(None, description="'fp8': quantize a 16-bit target's linear layers "
                                                "at load (an FP8 checkpoint loads as FP8 without it)")
    draft_quantization: Literal["fp8"] | None = Field(None, description="'fp8': the draft's linear layers too")

    @model_validator(mode="before")
    @classmethod
    def _demo_mtp_module(cls, data: object) -> object:
        """The demo target ships its MTP module beside it, not inside its checkpoint: point MTP there."""
        if not isinstance(data, dict) or data.get("target_model") not in (None, DEMO_TARGET):
            return data
        spec = data.get("spec_config")
        if isinstance(spec, MTPConfig) and spec.mtp_checkpoint is None:
            return {**data, "spec_config": spec.model_copy(update={"mtp_checkpoint": DEMO_MTP})}
        if isinstance(spec, dict) and spec.get("decoding_type") == "mtp" and spec.get("mtp_checkpoint") is None:
            return {**data, "spec_config": {**spec, "mtp_checkpoint": DEMO_MTP}}
        return data


def load_run_config(path: str | Path) -> RunConfig:
    """Read a YAML run file; errors name the file and the offending field."""
    path = Path(path)
    data = yaml.safe_load(path.read_text()) or {}
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
        raise ValueError(f"{path}: invalid config: {problems}") from None
