"""Draft training (EAGLE-3 heads, MTP modules) for frozen HF targets (the demo pair's recipe is in tools/).

Imported on demand (``from tllm_spec.training import train_draft``); decoding never needs it.
"""
from __future__ import annotations

from .draft import DraftTrainConfig, DraftTrainResult, train_draft
from .loop import LoopConfig, run_loop

__all__ = ["DraftTrainConfig", "DraftTrainResult", "LoopConfig", "run_loop", "train_draft"]
