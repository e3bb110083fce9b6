"""The speculative-decoding configs, one per draft kind (TensorRT-LLM's names): EAGLE-3 heads, MTP modules, a draft
LM (``DraftTargetConfig``) and suffix-automaton drafting (``SAConfig``); the first two can also take drafts from the
suffix automaton where the text repeats (``use_sa_spec``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .draft_shape import SCHEDULE_DESCRIPTION, check_draft_len_schedule, check_tree_fields
from .modes import SpeculativeDecodingMode

if TYPE_CHECKING:
    from .drafts.tree import DraftTree


class FrozenConfig(BaseModel):
    """Every tllm_spec config: immutable, unknown fields refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")


REJECTION_SAMPLING_DESCRIPTION = ("sampled requests draw drafts at their temperature/top-k/top-p and verify them by "
                                  "speculative (rejection) sampling; greedy requests keep exact argmax verification")


class SAEnhancerFields(FrozenConfig):
    """TensorRT-LLM's suffix-automaton enhancer of a head's drafts: per request, when the longest suffix of its text
    that occurred before is at least ``sa_spec_threshold`` tokens long, all K drafts are the text's continuation
    after that earlier occurrence, else the head's."""

    use_sa_spec: bool = Field(False, description="take a request's drafts from its suffix automaton when the text "
                              "repeats (the longest earlier match of its suffix >= sa_spec_threshold tokens)")
    sa_spec_threshold: int = Field(4, ge=1, le=1024, description="suffix-match length from which the automaton's "
                                   "drafts replace the head's (TensorRT-LLM's default 4)")


class Eagle3Config(SAEnhancerFields):
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
    use_rejection_sampling: bool = Field(False, description=REJECTION_SAMPLING_DESCRIPTION)
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


class MTPConfig(SAEnhancerFields):
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
    use_rejection_sampling: bool = Field(False, description=REJECTION_SAMPLING_DESCRIPTION)
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


class DraftTargetConfig(FrozenConfig):
    """A draft LM inside the target's step (TensorRT-LLM ``DraftTargetDecodingConfig``, run one-model:
    ``DRAFT_TARGET_ONE_MODEL``): any local Hugging Face causal LM of the target's vocabulary that the fused layers
    run (Llama, Qwen2, Qwen3, Mistral), e.g. Llama-3.2-1B for Llama-3.1-8B, Qwen3-0.6B for Qwen3-32B."""

    decoding_type: Literal["draft_target"] = "draft_target"
    speculative_model: str = Field(description="directory of the draft LM (config.json + safetensors), or "
                                   "demo://draft")
    max_draft_len: int = Field(3, ge=1, le=16, description="K: drafts proposed per step")
    draft_len_schedule: dict[int, int] | None = Field(None, description=SCHEDULE_DESCRIPTION)
    use_rejection_sampling: bool = Field(False, description=REJECTION_SAMPLING_DESCRIPTION)

    @model_validator(mode="after")
    def _check(self) -> DraftTargetConfig:
        check_draft_len_schedule(self.draft_len_schedule, self.max_draft_len)
        return self

    @property
    def spec_dec_mode(self) -> SpeculativeDecodingMode:
        return SpeculativeDecodingMode.DRAFT_TARGET_ONE_MODEL


class SAConfig(FrozenConfig):
    """Drafts copied from the text so far (TensorRT-LLM ``SADecodingConfig``, mode ``SA``): per request, the
    continuation of the longest suffix of its prompt and output that occurred before. No draft model; a step
    without a match verifies no drafts for that request."""

    decoding_type: Literal["sa"] = "sa"
    max_draft_len: int = Field(8, ge=1, le=32, description="K: drafts per step (8: a repeated span is usually "
                               "longer than a head's reach, and at batch 1 verifying 9 rows costs about one)")
    max_matching_ngram_size: int = Field(-1, ge=-1, le=1024, description="-1: the longest suffix match (at least "
                                         "one token); N > 0: a match of exactly the last N tokens (0 is invalid)")
    draft_len_schedule: dict[int, int] | None = Field(None, description=SCHEDULE_DESCRIPTION)
    enable_global_pool: bool = Field(False, description="also draft from the texts (prompt and output) of finished "
                                     "requests, where their match is longer than the request's own")
    global_pool_size: int = Field(65536, ge=1024, le=1 << 22, description="tokens of finished requests' texts the "
                                  "global pool keeps, the oldest evicted first (each running request matches the "
                                  "whole pool every step: O(K x size) work and 4 bytes x size per batch slot)")

    @model_validator(mode="after")
    def _check(self) -> SAConfig:
        if self.max_matching_ngram_size == 0:
            raise ValueError("max_matching_ngram_size 0 is invalid: -1 for the longest suffix match, or N >= 1 for a "
                             "match of exactly N tokens")
        check_draft_len_schedule(self.draft_len_schedule, self.max_draft_len)
        return self

    @property
    def spec_dec_mode(self) -> SpeculativeDecodingMode:
        return SpeculativeDecodingMode.SA


SpecConfig = Annotated[Eagle3Config | MTPConfig | DraftTargetConfig | SAConfig, Field(discriminator="decoding_type")]
