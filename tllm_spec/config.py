"""Typed, frozen configuration: sampling, speculative decoding (EAGLE-3 / MTP), engine, and YAML run files."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .draft_shape import SCHEDULE_DESCRIPTION, check_draft_len_schedule, check_tree_fields
from .modes import SpeculativeDecodingMode

if TYPE_CHECKING:
    from .drafts.tree import DraftTree

# A temperature below this is greedy (TensorRT-LLM's sentinel for "temperature disabled" is ~1e-5).
GREEDY_TEMPERATURE = 1e-4


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


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

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


class Eagle3Config(_Frozen):
    """EAGLE-3 one-model speculative decoding: a draft head fed three target hidden states."""

    decoding_type: Literal["eagle3"] = "eagle3"
    speculative_model: str = Field(description="directory of the EAGLE-3 head (config.json + safetensors)")
    max_draft_len: int = Field(3, ge=1, le=16, description="K: drafts proposed per step")
    draft_len_schedule: dict[int, int] | None = Field(None, description=SCHEDULE_DESCRIPTION)
    eagle3_one_model: bool = Field(True, description="draft inside the target forward (the only mode run here)")
    eagle3_layers_to_capture: tuple[int, ...] | None = Field(
        None, description="0-based target decoder layers whose OUTPUT feeds the head (TensorRT-LLM convention: "
        "output of layer i = residual stream entering layer i+1); a repeated id feeds that layer to fc twice. "
        "None: the head's config, else (1, L//2-1, L-4)")
    use_rejection_sampling: bool = Field(
        False, description="sampled requests draw drafts at their temperature/top-k/top-p and verify them by "
        "speculative (rejection) sampling; greedy requests keep exact argmax verification")
    max_total_draft_tokens: int | None = Field(None, ge=1, le=256, description="draft tokens of a tree (N); "
                                               "None: max_draft_len (a chain)")
    eagle_choices: list[list[int]] | None = Field(None, description="a static draft tree, one path of top-k ranks "
                                                  "per node from the root, e.g. [[0], [1], [0, 0]] (prefix-closed; "
                                                  "its depth is max_draft_len, its size max_total_draft_tokens)")
    use_dynamic_tree: bool = Field(False, description="a dynamic tree: each depth expands the top "
                                   "dynamic_tree_max_topK children of the frontier and keeps the "
                                   "max_total_draft_tokens nodes of highest cumulative draft probability")
    dynamic_tree_max_topK: int | None = Field(None, ge=1, le=64, description="children per frontier node of a "
                                              "dynamic tree")

    @model_validator(mode="after")
    def _check(self) -> Eagle3Config:
        layers = self.eagle3_layers_to_capture
        if layers is not None and (len(layers) != 3 or min(layers) < 0):
            raise ValueError(f"eagle3_layers_to_capture must be 3 non-negative layer ids (repeats allowed), "
                             f"got {layers}")
        self._check_tree()
        check_draft_len_schedule(self.draft_len_schedule, self.max_draft_len,
                                 self.total_draft_tokens if self.is_spec_dec_tree else None)
        return self

    def _check_tree(self) -> None:
        check_tree_fields(self.max_draft_len, self.max_total_draft_tokens, self.draft_tree, self.use_dynamic_tree,
                          self.dynamic_tree_max_topK)

    @property
    def draft_tree(self) -> DraftTree | None:
        """The static tree of ``eagle_choices`` (None: a chain or a dynamic tree)."""
        from .drafts.tree import DraftTree  # the drafts package imports this module

        return DraftTree.from_choices(self.eagle_choices) if self.eagle_choices is not None else None

    @property
    def is_spec_dec_tree(self) -> bool:
        """Drafts form a tree (static or dynamic); a chain is not one (TensorRT-LLM's SpecMetadata meaning)."""
        return self.use_dynamic_tree or (self.eagle_choices is not None and not self.draft_tree.is_chain)

    @property
    def total_draft_tokens(self) -> int:
        """Draft tokens verified per step: the tree's size, or max_draft_len for a chain."""
        if self.eagle_choices is not None:
            return self.draft_tree.num_nodes
        return self.max_total_draft_tokens or self.max_draft_len

    @property
    def spec_dec_mode(self) -> SpeculativeDecodingMode:
        mode = SpeculativeDecodingMode.EAGLE3_ONE_MODEL if self.eagle3_one_model else SpeculativeDecodingMode.EAGLE3
        return mode.check_supported()


class MTPConfig(_Frozen):
    """Multi-token prediction: MTP modules stored with the target (or at ``mtp_checkpoint``)."""

    decoding_type: Literal["mtp"] = "mtp"
    num_nextn_predict_layers: int = Field(1, ge=1, le=16, description="MTP modules to load from the checkpoint")
    max_draft_len: int | None = Field(None, ge=1, le=16, description="K; default 3 for MTP-Eagle (as EAGLE-3), "
                                      "num_nextn_predict_layers for vanilla MTP")
    draft_len_schedule: dict[int, int] | None = Field(None, description=SCHEDULE_DESCRIPTION + " (MTP-Eagle only)")
    use_mtp_vanilla: bool = Field(False, description="N distinct modules applied in sequence (TRT-LLM MTP)")
    mtp_eagle_one_model: bool = Field(True, description="module 0 reused for every draft step (MTP-Eagle)")
    mtp_checkpoint: str | None = Field(None, description="read MTP weights from here instead of the target dir")
    mtp_hidden_feedback: Literal["pre_norm", "post_norm"] = Field(
        "post_norm", description="hidden handed to the next draft step / module: after shared_head.norm "
        "(default: the input hnorm was trained on; TensorRT-LLM DeepseekV3MTP.forward returns "
        "shared_head.norm(hidden_states, residual) and MTPEagleWorker feeds it back; SGLang deepseek_nextn and vLLM "
        "since PR #45895 do the same) or the block output before it (what tllm_spec's shipped demo module was "
        "trained with)")
    mtp_layer_selection: Literal["first", "per_step"] = Field(
        "first", description="MTP-Eagle: the module that drafts step k. 'first': module 0 for every step "
        "(TensorRT-LLM MTPEagleWorker); 'per_step': module k mod num_nextn_predict_layers, each with its own KV "
        "layer and shared_head (vLLM's spec_step_idx % num_mtp_layers, Step-3.5's round-robin MTP layers)")
    use_rejection_sampling: bool = Field(
        False, description="sampled requests draw drafts at their temperature/top-k/top-p and verify them by "
        "speculative (rejection) sampling; greedy requests keep exact argmax verification")
    use_relaxed_acceptance_for_thinking: bool = Field(
        False, description="lossy: inside <think> accept drafts among the target's top-k within relaxed_delta")
    relaxed_topk: int = Field(1, ge=1, le=64, description="candidates considered by relaxed acceptance")
    relaxed_delta: float = Field(0.0, ge=0.0, le=1.0, description="accept if prob >= top-1 prob - delta")
    begin_thinking_phase_token: int | None = Field(None, ge=0, description="token id that opens thinking")
    end_thinking_phase_token: int | None = Field(None, ge=0, description="token id that closes thinking")

    @model_validator(mode="after")
    def _check(self) -> MTPConfig:
        if self.use_mtp_vanilla and self.max_draft_len not in (None, self.num_nextn_predict_layers):
            raise ValueError("max_draft_len: vanilla MTP drafts exactly num_nextn_predict_layers tokens")
        if self.use_mtp_vanilla and self.mtp_layer_selection != "first":
            raise ValueError("mtp_layer_selection is an MTP-Eagle option (vanilla MTP runs module k for step k)")
        if self.use_mtp_vanilla and self.draft_len_schedule is not None:
            raise ValueError("draft_len_schedule: vanilla MTP drafts exactly num_nextn_predict_layers tokens")
        check_draft_len_schedule(self.draft_len_schedule, self.num_draft_tokens)
        if self.use_relaxed_acceptance_for_thinking and (
                self.begin_thinking_phase_token is None or self.end_thinking_phase_token is None):
            raise ValueError("begin_thinking_phase_token/end_thinking_phase_token are required with "
                             "use_relaxed_acceptance_for_thinking")
        return self

    @property
    def num_draft_tokens(self) -> int:
        if self.max_draft_len is not None:
            return self.max_draft_len
        return self.num_nextn_predict_layers if self.use_mtp_vanilla else max(3, self.num_nextn_predict_layers)

    @property
    def spec_dec_mode(self) -> SpeculativeDecodingMode:
        if self.use_mtp_vanilla:
            mode = SpeculativeDecodingMode.MTP
        elif self.mtp_eagle_one_model:
            mode = SpeculativeDecodingMode.MTP_EAGLE_ONE_MODEL
        else:
            mode = SpeculativeDecodingMode.MTP_EAGLE
        return mode.check_supported()


SpecConfig = Annotated[Eagle3Config | MTPConfig, Field(discriminator="decoding_type")]


ADMISSION_WINDOW_CAP = 20  # an idle engine waits at most this many admission windows for a burst to end


class EngineConfig(_Frozen):
    """Capacity of the decoding engine."""

    max_batch_size: int = Field(8, ge=1, le=1024, description="requests decoded together")
    max_seq_len: int | None = Field(None, ge=8, description="prompt + generated tokens; default from the target")
    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV-cache page")
    num_pages: int | None = Field(None, ge=1, description="KV pages in the pool; default: enough for "
                                  "max_batch_size full sequences (CPU) or kv_cache_fraction of free memory (GPU)")
    kv_cache_fraction: float = Field(0.5, gt=0.0, lt=1.0, description="GPU free memory given to the KV pool")
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
    enforce_eager: bool = Field(False, description="never capture CUDA graphs (debugging)")
    use_fused_layers: bool = Field(True, description="run supported targets (Llama, Qwen2, Qwen3, Mistral), "
                                   "EAGLE-3 heads and MTP modules through tllm_spec's layers with fused q/k/v and "
                                   "gate/up GEMMs; False: the stock HF modules")
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
                                      "launch with torchrun --nproc-per-node N (gloo on CPU); the draft is "
                                      "replicated on every rank")
    tp_all_reduce: Literal["auto", "nccl"] = Field("auto", description="tensor parallel on GPUs: 'auto' sums "
                                                   "inputs up to 512 KB (the decoding steps' all-reduces) with a "
                                                   "one-shot kernel over peer-to-peer symmetric memory where "
                                                   "torch and the GPUs allow it, larger ones through NCCL; "
                                                   "'nccl': every all-reduce through NCCL")

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
    spec_config: SpecConfig | None = Field(None, description="eagle3 / mtp; None = plain decoding (MTP on the demo "
                                           "target without mtp_checkpoint reads the demo's module, demo://mtp)")
    sampling: SamplingParams = SamplingParams()
    engine: EngineConfig = EngineConfig()
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    device: str = Field("auto", description="'cpu', 'cuda', 'cuda:1' or 'auto'")

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
