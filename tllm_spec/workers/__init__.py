"""Speculative workers: the part of the one-model step after the target's logits."""
from .base import SpecWorkerBase

__all__ = ["SpecWorkerBase"]
