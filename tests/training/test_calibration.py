"""Temperature calibration of an EAGLE-3 head: the best overlap of the grid is folded into lm_head (logits scale
by 1 / tau, argmax unchanged), calibration alone runs with steps=0, and the config refuses what it cannot do."""
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from tllm_spec.training import train_draft

from .helpers import train_config, trained


def test_calibration_folds_the_best_temperature_into_the_head():
    head = trained("eagle3").out
    result = train_draft(train_config("eagle3", "run-calibrated", init_from=str(head), steps=0,
                                      calibrate_temperature=True, save_dtype="float32"))
    calibration = result.summary["calibration"]
    scores, tau = calibration["overlap"], calibration["temperature"]
    assert scores[tau] == max(scores.values()) and scores[tau] >= scores[1.0]
    before = load_file(str(head / "model.safetensors"))["lm_head.weight"].float()
    after = load_file(str(result.out / "model.safetensors"))["lm_head.weight"]
    torch.testing.assert_close(after, before / tau)
    assert result.summary["steps"] == 0


def test_steps_zero_needs_an_existing_draft():
    with pytest.raises(ValidationError, match="init_from"):
        train_config("eagle3", "run-nothing", steps=0)


def test_calibration_is_for_eagle3_heads():
    with pytest.raises(ValidationError, match="EAGLE-3"):
        train_config("mtp", "run-mtp-calibrated", calibrate_temperature=True)
