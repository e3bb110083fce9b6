"""Draft training (EAGLE-3 heads, MTP modules) for frozen HF targets, and the embedded demo pair's recipe.

Imported on demand (``from tllm_spec.training import train_draft``); decoding never needs it.
"""
from __future__ import annotations

from .draft import DraftTrainConfig, DraftTrainResult, train_draft
from .loop import LoopConfig, run_loop
from .recipe import RecipeShape, build_demo_models

__all__ = ["DraftTrainConfig", "DraftTrainResult", "LoopConfig", "RecipeShape", "build_demo_models", "run_loop",
           "train_draft"]
