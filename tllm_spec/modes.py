"""SpeculativeDecodingMode: the TensorRT-LLM mode names and predicates, and which modes this package runs.

The predicates reproduce ``SpeculativeDecodingMode`` of TensorRT-LLM's
``tensorrt_llm/_torch/speculative/interface.py`` at commit b35ac1b64368 (the revision whose members are exactly
these eleven) with identical truth tables but one: ``support_overlap_scheduler`` is True for MTP_EAGLE, as in
later revisions. Those add members (SA, PARD, DFLASH, DSPARK, DRAFT_TARGET_ONE_MODEL) and, over these eleven,
also differ in ``has_spec_drafter`` (SAVE_HIDDEN_STATES becomes False) and the arguments of ``extend_ctx`` /
``attention_need_spec_dec_mode``. tllm_spec's own predicates carry names TensorRT-LLM does not use
(:meth:`supported`, :meth:`check_supported`).
"""
from __future__ import annotations

from enum import IntEnum, auto


class SpeculativeDecodingMode(IntEnum):
    """TensorRT-LLM's speculative-decoding modes.

    tllm_spec runs the one-model modes only (the draft network lives inside the target's forward):
    ``EAGLE3_ONE_MODEL``, ``MTP`` (vanilla MTP, N distinct modules), ``MTP_EAGLE_ONE_MODEL`` (module 0
    reused for every draft step) and ``NONE``. The other members exist so that names users know from
    TensorRT-LLM parse, and are refused with a clear error by :meth:`check_supported`.
    """

    MTP = auto()
    MTP_EAGLE = auto()
    MTP_EAGLE_ONE_MODEL = auto()
    EAGLE3 = auto()
    EAGLE3_ONE_MODEL = auto()
    NGRAM = auto()
    DRAFT_TARGET = auto()
    USER_PROVIDED = auto()
    SAVE_HIDDEN_STATES = auto()
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
        return (cls.EAGLE3_ONE_MODEL, cls.MTP, cls.MTP_EAGLE_ONE_MODEL, cls.NONE)

    def check_supported(self) -> SpeculativeDecodingMode:
        """Return self, or raise naming the modes this package runs (not a TensorRT-LLM predicate)."""
        if self not in self.supported():
            names = ", ".join(m.name for m in self.supported())
            raise NotImplementedError(
                f"speculative decoding mode {self.name} is not run by tllm_spec (two-model and external-drafter "
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

    def is_user_provided(self) -> bool:
        return self is SpeculativeDecodingMode.USER_PROVIDED

    def is_none(self) -> bool:
        return self is SpeculativeDecodingMode.NONE

    def is_draft_target(self) -> bool:
        return self is SpeculativeDecodingMode.DRAFT_TARGET

    def is_save_hidden_states(self) -> bool:
        return self is SpeculativeDecodingMode.SAVE_HIDDEN_STATES

    def use_one_engine(self) -> bool:
        """Draft and target run in one model forward."""
        return self.is_eagle3_one_model() or self.is_mtp_one_model()

    def without_logits(self) -> bool:
        """The model's forward returns the speculative outputs rather than logits for an external sampler."""
        return self.is_mtp_one_model() or self.is_eagle3_one_model()

    def needs_kv_cache_rewind(self) -> bool:
        """Rejected drafts leave target KV entries behind that the engine rewinds (here: by length)."""
        return self.is_mtp_one_model() or self.is_eagle3_one_model() or self.is_ngram()

    def support_overlap_scheduler(self) -> bool:
        """As later TensorRT-LLM revisions have it: every mode with a draft model, MTP_EAGLE included (the
        pinned revision excluded MTP_EAGLE under a "TODO: fix accuracy issue")."""
        return self.is_mtp_one_model() or self.is_eagle3_one_model() or self.has_draft_model()

    def support_guided_decoder(self) -> bool:
        return self.is_none() or self.has_spec_drafter()

    def support_capturable_guided_decoder(self) -> bool:
        return self.is_mtp_one_model() or self.is_eagle3_one_model()

    def has_draft_model(self) -> bool:
        """A *separate* draft model engine (two-model modes). False for the one-model modes, whose draft
        network lives inside the target's forward."""
        return self.is_eagle3() or self.is_draft_target() or self.is_mtp_eagle()

    def needs_kv_cache_recompute(self) -> bool:
        """The first draft forward recomputes the draft KV of the accepted tokens (two-model EAGLE-3 / MTP)."""
        return self.is_eagle3() or self.is_mtp_eagle()

    def need_load_draft_weights(self) -> bool:
        """Draft and target share one model engine and the draft's weights come from a separate checkpoint."""
        return self.is_eagle3_one_model()

    def has_spec_decoder(self) -> bool:
        return self.is_mtp_one_model() or self.is_mtp_eagle() or self.is_eagle3() or self.is_eagle3_one_model()

    def has_spec_drafter(self) -> bool:
        return (self.is_eagle3() or self.is_draft_target() or self.is_ngram() or self.is_user_provided()
                or self.is_mtp_eagle() or self.is_save_hidden_states())

    def extend_ctx(self, multi_token_query_attention: bool = True, sm_version: int | None = None) -> bool:
        """Treat generation requests with drafts as chunked context requests at the kernel level.

        TensorRT-LLM takes ``attention_backend`` (a class); ``multi_token_query_attention`` stands for
        ``issubclass(attention_backend, TrtllmAttention)``, i.e. a kernel that runs a generation request's
        K+1 tokens as one multi-token query (tllm_spec's own attention is one, hence the default).
        ``sm_version`` is TensorRT-LLM's ``get_sm_version()`` (None: read from the current CUDA device, 0
        without one).
        """
        if self.use_one_engine():
            return False  # one-model handles draft tokens itself
        if multi_token_query_attention and self.is_mtp_eagle():
            return False  # TRT-LLM: its MLA kernel does not work in chunked-context mode
        return not multi_token_query_attention or _sm_version(sm_version) != 100

    def attention_need_spec_dec_mode(self, is_first_draft: bool, is_draft_model: bool,
                                     multi_token_query_attention: bool = True, use_chain_drafter: bool = False,
                                     is_spec_dec_tree: bool = False) -> bool:
        """The attention kernel runs in spec-dec (multi-token query) mode.

        TensorRT-LLM's arguments are ``(spec_resource_manager, is_draft_model, attention_backend,
        use_chain_drafter, is_spec_dec_tree)``: ``is_first_draft`` stands for
        ``spec_resource_manager.is_first_draft`` and ``multi_token_query_attention`` for
        ``issubclass(attention_backend, TrtllmAttention)``. ``is_spec_dec_tree`` is unused there too.
        """
        return self.is_eagle3_one_model() or (
            self.is_eagle3() and is_first_draft and multi_token_query_attention and use_chain_drafter
            and is_draft_model)


def _sm_version(sm_version: int | None) -> int:
    if sm_version is not None:
        return sm_version
    import torch

    if not torch.cuda.is_available():
        return 0
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor
