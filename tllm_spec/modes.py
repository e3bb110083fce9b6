"""SpeculativeDecodingMode: the TensorRT-LLM mode names, and which of them this package runs."""
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
        return (cls.EAGLE3_ONE_MODEL, cls.MTP, cls.MTP_EAGLE_ONE_MODEL, cls.NONE)

    def check_supported(self) -> SpeculativeDecodingMode:
        """Return self, or raise naming the modes this package runs."""
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

    def is_none(self) -> bool:
        return self is SpeculativeDecodingMode.NONE

    def use_one_engine(self) -> bool:
        """Draft and target run in one model forward."""
        return self.is_eagle3_one_model() or self.is_mtp_one_model()

    def needs_kv_cache_rewind(self) -> bool:
        """Rejected drafts leave KV entries behind that the engine rewinds (by length)."""
        return self.use_one_engine() or self in (SpeculativeDecodingMode.EAGLE3, SpeculativeDecodingMode.MTP_EAGLE,
                                                 SpeculativeDecodingMode.NGRAM, SpeculativeDecodingMode.DRAFT_TARGET)

    def has_draft_model(self) -> bool:
        """A draft network (EAGLE-3 head or MTP modules) is loaded."""
        return self.use_one_engine()
