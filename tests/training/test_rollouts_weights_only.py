"""Rollouts files are read weights-only: what train_draft writes loads back, and a file carrying any other pickled
object is refused before that object's code can run."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tllm_spec.training import train_draft

from .helpers import train_config


class TouchOnUnpickle:
    """Unpickling this creates ``marker``: the arbitrary code a plain torch.load would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_rollouts_file_with_a_pickled_object_is_refused(tmp_path):
    path, marker = tmp_path / "rollouts.pt", tmp_path / "code-ran"
    settings = dict(steps=1, rollout_sequences=4, rollout_prompt_tokens=8, rollouts_file=str(path))
    train_draft(train_config("mtp", "run-rollouts-weights-only", **settings))
    stored = torch.load(path, weights_only=True)  # what train_draft writes is plain tensors and values
    torch.save({**stored, "extra": TouchOnUnpickle(marker)}, path)  # the settings still match this run's
    with pytest.raises(ValueError, match="refused"):
        train_draft(train_config("mtp", "run-rollouts-weights-only", **settings))
    assert not marker.exists()
