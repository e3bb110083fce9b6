"""Self-distillation rollouts: prompts are windows of the stream, the greedy half is the target's own greedy
continuation, the sampled half depends on the seed only, and train_draft mixes them into its batches."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from tllm_spec.training import train_draft
from tllm_spec.training.data import sample_rows
from tllm_spec.training.rollout import generate_rollouts

from ..models import hf_greedy
from .helpers import tiny_target, train_config


def rollouts(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed + 100)  # the global RNG must not matter
    model = AutoModelForCausalLM.from_pretrained(tiny_target(), dtype=torch.float32)
    stream = torch.arange(3, 203, dtype=torch.int32)  # window starts are visible in the prompts
    return stream, generate_rollouts(model, stream, num_sequences=5, prompt_tokens=6, seq_len=20, batch_size=2,
                                     seed=seed)


def test_greedy_half_is_the_target_greedy_continuation():
    _, out = rollouts(seed=0)
    assert out.shape == (5, 20) and out.dtype == torch.int32
    assert bool((out[:, 1:6] - out[:, :5] == 1).all())  # each prompt is a contiguous window of the stream
    for row in out[:3].tolist():  # tensor_split: 3 greedy rows, 2 sampled
        assert row[6:] == hf_greedy(tiny_target(), row[:6], 14)


def test_sampled_half_depends_on_the_seed_alone():
    a, b, c = rollouts(seed=0)[1], rollouts(seed=0)[1], rollouts(seed=1)[1]
    assert torch.equal(a, b)
    assert not torch.equal(a[3:, 6:], c[3:, 6:])


def test_sample_rows_is_deterministic_per_step():
    rows = torch.arange(40).view(10, 4)
    first = sample_rows(rows, 6, seed=0, step=3)
    assert first.shape == (6, 4) and first.dtype == torch.int64
    assert torch.equal(first, sample_rows(rows, 6, seed=0, step=3))
    assert bool(((first[:, 1:] - first[:, :-1]) == 1).all())  # whole rows


def test_train_draft_with_rollouts_reports_both_heldout_sets():
    result = train_draft(train_config("mtp", "run-rollouts", steps=3, rollout_sequences=4, rollout_prompt_tokens=8,
                                      rollout_share=0.5))
    assert result.summary["rollout_tokens"] == 4 * 48
    assert set(result.summary["heldout_rollouts"]) >= {"loss", "acc0", "acc1", "acc2"}


@pytest.mark.slow  # four to five seconds on the 2-core machine, out of the README command for its margin
def test_rollouts_file_is_written_once_and_reused(tmp_path):
    path = tmp_path / "rollouts.pt"
    settings = dict(steps=1, rollout_sequences=4, rollout_prompt_tokens=8, rollouts_file=str(path))
    train_draft(train_config("mtp", "run-rollouts-file", **settings))
    stored = torch.load(path, weights_only=True)
    assert stored["rollouts"].shape == (4, 48) and stored["seed"] == 0
    torch.save({**stored, "rollouts": stored["rollouts"].flip(0)}, path)  # a rerun that regenerated would undo it
    again = train_draft(train_config("mtp", "run-rollouts-file", **settings))
    assert again.summary["rollout_tokens"] == 4 * 48
    assert torch.equal(torch.load(path, weights_only=True)["rollouts"], stored["rollouts"].flip(0))
    torch.save({k: v for k, v in stored.items() if k != "temperatures"}, path)  # written before the setting
    assert train_draft(train_config("mtp", "run-rollouts-file", **settings)).summary["rollout_tokens"] == 4 * 48
    for other in ({"rollout_sequences": 6}, {"seed": 1}, {"rollout_prompt_tokens": 6},
                  {"rollout_temperatures": (0.0, 1.0, 1.0)}):
        with pytest.raises(ValueError, match="rollouts made with"):
            train_draft(train_config("mtp", "run-rollouts-file", **{**settings, **other}))


def test_rollout_temperatures_set_the_share_of_greedy_rows(tmp_path):
    path = tmp_path / "rollouts.pt"
    train_draft(train_config("mtp", "run-rollout-temperatures", steps=1, rollout_sequences=6, rollout_prompt_tokens=8,
                             rollout_temperatures=(0.0, 1.0, 1.0), rollouts_file=str(path)))
    rows = torch.load(path, weights_only=True)["rollouts"]
    # the first 8 new tokens (batched and one-row argmaxes of the random tiny target part at near-ties later on)
    greedy = [row.tolist()[8:16] == hf_greedy(tiny_target(), row.tolist()[:8], 8) for row in rows]
    assert greedy == [True, True, False, False, False, False]  # a third greedy (the default: half)
    with pytest.raises(ValueError, match="temperatures are >= 0"):
        train_config("mtp", "run-rollout-temperatures", rollout_sequences=6, rollout_temperatures=(-1.0,))
