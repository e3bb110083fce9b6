"""SpeculativeDecodingMode: the TensorRT-LLM mode names and predicates, and which modes this package runs.

The predicates reproduce ``SpeculativeDecodingMode`` of TensorRT-LLM's
``tensorrt_llm/_torch/speculative/interface.py`` in its 2026 revision whose members are exactly these fifteen
(SA, DRAFT_TARGET_ONE_MODEL, PARD and DFLASH added to the eleven of commit b35ac1b64368), with identical truth
tables. An attention-backend argument becomes a flag (``multi_token_query_attention``: TensorRT-LLM's own
attention) and ``spec_resource_manager.is_first_draft`` the ``is_first_draft`` flag. tllm_spec's own predicates
carry names TensorRT-LLM does not use (:meth:`supported`, :meth:`check_supported`).
"""
from __future__ import annotations

from enum import IntEnum, auto


class SpeculativeDecodingMode(IntEnum):
    """TensorRT-LLM's speculative-decoding modes.

    tllm_spec runs the one-model modes only (the draft lives inside the target's forward):
    ``EAGLE3_ONE_MODEL``, ``MTP`` (vanilla MTP, N distinct modules), ``MTP_EAGLE_ONE_MODEL`` (module 0
    reused for every draft step), ``DRAFT_TARGET_ONE_MODEL`` (a small LM of the target's vocabulary), ``SA``
    (drafts copied from the text so far) and ``NONE``. The other members exist so that names users know from
    TensorRT-LLM parse, and are refused with a clear error by :meth:`check_supported`.
    """

    MTP = auto()
    MTP_EAGLE = auto()
    MTP_EAGLE_ONE_MODEL = auto()
    EAGLE3 = auto()
    EAGLE3_ONE_MODEL = auto()
    NGRAM = auto()
    SA = auto()
    DRAFT_TARGET = auto()
    DRAFT_TARGET_ONE_MODEL = auto()
    USER_PROVIDED = auto()
    SAVE_HIDDEN_STATES = auto()
    PARD = auto()
    DFLASH = auto()
    NONE = auto()
    AUTO = auto()

    @classmethod
    def from_string(cls, name: str | None) -> SpeculativeDecodingMode:
        """Parse a mode name case-insensitively; ``None`` means ``NONE``."""
        if name is None:
            return cls.NONE
        try:
            return cls[name.strip().upper()]
        except KeyError:
            known = ", ".join(m.name for m in cls)
            raise ValueError(f"unknown speculative decoding mode {name!r}; known modes: {known}") from None

    @classmethod
    def supported(cls) -> tuple[SpeculativeDecodingMode, ...]:
        """The modes tllm_spec runs (not a TensorRT-LLM predicate)."""
        return (cls.EAGLE3_ONE_MODEL, cls.MTP, cls.MTP_EAGLE_ONE_MODEL, cls.DRAFT_TARGET_ONE_MODEL, cls.SA, cls.NONE)

    def check_supported(self) -> SpeculativeDecodingMode:
        """Return self, or raise naming the modes this package runs (not a TensorRT-LLM predicate)."""
        if self not in self.supported():
            names = ", ".join(m.name for m in self.supported())
            raise NotImplementedError(
                f"speculative decoding mode {self.name} is not run by tllm_spec (two-model and parallel-draft "
                f"modes are out of scope); supported modes: {names}")
        return self

    def is_mtp_one_model(self) -> bool:
        return self in (SpeculativeDecodingMode.MTP, SpeculativeDecodingMode.MTP_EAGLE_ONE_MODEL)

    def is_mtp_eagle_one_model(self) -> bool:
        return self is SpeculativeDecodingMode.MTP_EAGLE_ONE_MODEL

    def is_mtp_vanilla(self) -> bool:
        return self is SpeculativeDecodingMode.MTP

    def is_mtp_eagle(self) -> bool:
        return self is SpeculativeDecodingMode.MTP_EAGLE

    def is_eagle3(self) -> bool:
        return self is SpeculativeDecodingMode.EAGLE3

    def is_eagle3_one_model(self) -> bool:
        return self is SpeculativeDecodingMode.EAGLE3_ONE_MODEL

    def is_ngram(self) -> bool:
        return self is SpeculativeDecodingMode.NGRAM

    def is_sa(self) -> bool:
        return self is SpeculativeDecodingMode.SA

    def is_pard(self) -> bool:
        return self is SpeculativeDecodingMode.PARD

    def is_dflash(self) -> bool:
        return self is SpeculativeDecodingMode.DFLASH

    def is_parallel_draft(self) -> bool:
        return self.is_pard() or self.is_dflash()

    def is_user_provided(self) -> bool:
        return self is SpeculativeDecodingMode.USER_PROVIDED

    def is_none(self) -> bool:
        return self is SpeculativeDecodingMode.NONE

    def is_draft_target(self) -> bool:
        return self is SpeculativeDecodingMode.DRAFT_TARGET

    def is_draft_target_one_model(self) -> bool:
        return self is SpeculativeDecodingMode.DRAFT_TARGET_ONE_MODEL

    def is_external_drafter(self) -> bool:
        """A draft network with its own checkpoint and layers inside the target's step (a draft LM, PARD)."""
        return self.is_parallel_draft() or self.is_draft_target_one_model()

    def is_save_hidden_states(self) -> bool:
        return self is SpeculativeDecodingMode.SAVE_HIDDEN_STATES

    def use_one_engine(self) -> bool:
        """Draft and target run in one model forward."""
        return self.is_eagle3_one_model() or self.is_mtp_one_model() or self.is_external_drafter() or self.is_sa()

    def without_logits(self) -> bool:
        """The model's forward returns the speculative outputs rather than logits for an external sampler."""
        return self.is_mtp_one_model() or self.is_eagle3_one_model() or self.is_external_drafter() or self.is_sa()

    def needs_kv_cache_rewind(self) -> bool:
        """Rejected drafts leave target KV entries behind that the engine rewinds (here: by length)."""
        return (self.is_mtp_one_model() or self.is_eagle3_one_model() or self.is_ngram() or self.is_sa()
                or self.is_external_drafter())

    def support_overlap_scheduler(self) -> bool:
        return (self.is_mtp_one_model() or self.is_eagle3_one_model() or self.is_sa() or self.has_draft_model()
                or self.is_external_drafter())

    def support_guided_decoder(self) -> bool:
        return self.is_none() or self.has_spec_drafter()

    def support_capturable_guided_decoder(self) -> bool:
        return self.is_mtp_one_model() or self.is_eagle3_one_model() or self.is_external_drafter() or self.is_sa()

    def support_dynamic_draft_len(self) -> bool:
        """TensorRT-LLM's answer (EAGLE-3 one-model only, "expand to all one-model algorithms"); tllm_spec's
        ``draft_len_schedule`` also runs for MTP-Eagle and the draft LM (engine/draft_len.py)."""
        return self.is_eagle3_one_model()

    def has_draft_model(self) -> bool:
        """A *separate* draft model engine (two-model modes). False for the one-model modes, whose draft
        network lives inside the target's forward."""
        return self.is_eagle3() or self.is_draft_target() or self.is_mtp_eagle()

    def needs_kv_cache_recompute(self) -> bool:
        """The first draft forward recomputes the draft KV of the accepted tokens (two-model EAGLE-3 / MTP)."""
        return self.is_eagle3() or self.is_mtp_eagle()

    def need_load_draft_weights(self) -> bool:
        """Draft and target share one model engine and the draft's weights come from a separate checkpoint."""
        return self.is_eagle3_one_model() or self.is_external_drafter()

    def has_spec_decoder(self) -> bool:
        return (self.is_mtp_one_model() or self.is_mtp_eagle() or self.is_eagle3() or self.is_eagle3_one_model()
                or self.is_external_drafter() or self.is_sa())

    def has_spec_drafter(self) -> bool:
        return (self.is_eagle3() or self.is_draft_target() or self.is_ngram() or self.is_user_provided()
                or self.is_mtp_eagle())

    def extend_ctx(self, multi_token_query_attention: bool = True, sm_version: int | None = None) -> bool:
        """Treat generation requests with drafts as chunked context requests at the kernel level.

        TensorRT-LLM takes ``attention_backend`` (a class); ``multi_token_query_attention`` stands for
        ``issubclass(attention_backend, TrtllmAttention)``, i.e. a kernel that runs a generation request's
        K+1 tokens as one multi-token query (tllm_spec's own attention is one, hence the default), whose XQA
        path runs below SM 120. ``sm_version`` is TensorRT-LLM's ``get_sm_version()`` (None: read from the
        current CUDA device, 0 without one).
        """
        if self.use_one_engine():
            return False  # one-model handles draft tokens itself
        return not multi_token_query_attention or _sm_version(sm_version) >= 120

    def attention_need_spec_dec_mode(self, is_first_draft: bool, is_draft_model: bool,
                                     multi_token_query_attention: bool = True, use_chain_drafter: bool = False
                                     ) -> bool:
        """The attention kernel runs in spec-dec (multi-token query) mode: always in one-model modes; in two-model
        modes for the target, or the first draft of a capturable drafting loop, on TensorRT-LLM's attention.

        TensorRT-LLM's arguments are ``(spec_resource_manager, is_draft_model, attention_backend,
        use_chain_drafter)``: ``is_first_draft`` stands for ``spec_resource_manager.is_first_draft`` and
        ``multi_token_query_attention`` for ``issubclass(attention_backend, TrtllmAttention)``.
        """
        if self.use_one_engine():
            return True
        return (not is_draft_model or (is_first_draft and use_chain_drafter)) and multi_token_query_attention


def _sm_version(sm_version: int | None) -> int:
    if sm_version is not None:
        return sm_version
    import torch

    if not torch.cuda.is_available():
        return 0
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor
