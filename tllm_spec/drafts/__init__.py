"""Speculation after the target's logits: the worker base (sampling, acceptance, forcing), its step metadata,
plain decoding, and one subpackage per draft kind (``eagle3/``, ``mtp/``: model, checkpoint, worker)."""
from .base import SpecWorkerBase
from .metadata import SpecMetadata

__all__ = ["SpecMetadata", "SpecWorkerBase"]
