"""train_draft on a tiny random target: the loss goes down, the written checkpoints load through the public API
and decode losslessly, resume continues from the saved step."""
import json

import pytest
import torch
from safetensors.torch import load_file

from tllm_spec import Eagle3Config, MTPConfig, SamplingParams, SpecModel
from tllm_spec.drafts.eagle3.checkpoint import load_eagle3_checkpoint
from tllm_spec.drafts.eagle3.model import resolve_capture_layers
from tllm_spec.training import train_draft
from tllm_spec.training.draft import SUMMARY_FILE
from tllm_spec.training.eagle3 import _stored_aux_ids

from ..models import hf_greedy
from .helpers import tiny_target, train_config, trained

PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
MAX_NEW = [14, 9, 17]


def window_means(losses, width=8):
    return sum(losses[:width]) / width, sum(losses[-width:]) / width


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_training_decreases_the_loss(kind):
    result = trained(kind)
    first, last = window_means(result.losses)
    assert len(result.losses) == 40
    assert last < 0.9 * first, (first, last)
    summary = json.loads((result.out / SUMMARY_FILE).read_text())
    assert summary["steps"] == 40 and set(summary["heldout"]) >= {"loss", "acc0", "acc1", "acc2"}


def check_lossless(model):
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    for prompt, n, out in zip(PROMPTS, MAX_NEW, outs):
        assert out.token_ids == hf_greedy(tiny_target(), prompt, n), f"prompt {prompt}"
    assert outs.stats["steps"] > 0


def test_trained_eagle3_head_loads_and_decodes_losslessly():
    head = trained("eagle3").out
    ckpt = load_eagle3_checkpoint(head)
    assert ckpt.config.draft_vocab_size == 96 and ckpt.config.dialect == "eagle"
    assert ckpt.state_dict["fc.weight"].dtype == torch.bfloat16  # the default save dtype
    assert "t2d" in load_file(str(head / "model.safetensors"))  # written for reduced vocabularies
    model = SpecModel.from_pretrained(tiny_target(), Eagle3Config(speculative_model=str(head), max_draft_len=3),
                                      max_batch_size=3)
    assert model.target._capture_ids == (1, 3, 4)  # the default aux layers of an 8-layer target, read back
    check_lossless(model)


def test_trained_mtp_module_loads_and_decodes_losslessly():
    out = trained("mtp").out
    model = SpecModel.from_pretrained(tiny_target(), MTPConfig(max_draft_len=3, mtp_checkpoint=str(out)),
                                      max_batch_size=3)
    check_lossless(model)


def test_vanilla_mtp_two_modules():
    result = train_draft(train_config("mtp", "run-vanilla", num_modules=2, ttt_steps=2, steps=3))
    assert set(result.summary["last_step"]) == {"loss", "acc0", "acc1", "overlap0", "overlap1"}
    config = MTPConfig(num_nextn_predict_layers=2, use_mtp_vanilla=True, mtp_checkpoint=str(result.out))
    check_lossless(SpecModel.from_pretrained(tiny_target(), config, max_batch_size=3))


def test_resume_continues_from_the_saved_step():
    first = train_draft(train_config("eagle3", "run-resume", steps=3))
    head_before = load_file(str(first.out / "model.safetensors"))["fc.weight"]
    resumed = train_draft(train_config("eagle3", "run-resume", steps=5, resume=True))
    assert len(resumed.losses) == 2 and resumed.summary["steps"] == 5
    assert not torch.equal(load_file(str(resumed.out / "model.safetensors"))["fc.weight"], head_before)
    with pytest.raises(FileNotFoundError, match="trainer_state"):
        train_draft(train_config("eagle3", "run-never-started", steps=2, resume=True))


@pytest.mark.parametrize("layers", [(1, 3, 4), (2, 4, 5), (3, 5, 6), (1, 2, 2), (2, 3, 3)])
def test_aux_layers_read_back_as_trained(layers):
    assert resolve_capture_layers(None, _stored_aux_ids(layers), 8) == layers


def test_aux_layer_zero_is_refused():
    with pytest.raises(ValueError, match="layer 0"):
        _stored_aux_ids((0, 3, 5))


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="draft_vocab"):
        train_config("mtp", "x", draft_vocab=64)
    with pytest.raises(ValueError, match="init_from"):
        train_config("eagle3", "x", init_from="somewhere", draft_vocab=64)
    with pytest.raises(ValueError, match="MTP modules keep"):
        train_config("mtp", "x", init_from="somewhere", intermediate_size=64)


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_init_from_starts_at_the_existing_draft(kind):
    """A fine-tune with a negligible learning rate writes back the weights it started from, shape and draft
    vocabulary included, and scores what the original scores on the held-out files."""
    original = trained(kind)
    tuned = train_draft(train_config(kind, f"run-init-{kind}", steps=1, lr=1e-12, warmup_steps=0,
                                     init_from=str(original.out)))
    name = "model.safetensors" if kind == "eagle3" else "model-mtp.safetensors"
    before, after = load_file(str(original.out / name)), load_file(str(tuned.out / name))
    assert set(before) == set(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    for level in ("acc0", "acc1", "acc2"):
        assert abs(tuned.summary["heldout"][level] - original.summary["heldout"][level]) < 0.02


def test_init_from_widens_the_head_mlp_without_changing_what_it_computes():
    """intermediate_size with init_from: the old units are kept, the new ones start silent (zero down-projection
    columns), so the widened head scores exactly what the original scores; narrowing is refused."""
    original = trained("eagle3")
    down, gate = "midlayer.mlp.down_proj.weight", "midlayer.mlp.gate_proj.weight"
    before = load_file(str(original.out / "model.safetensors"))
    width = before[down].shape[1]
    wider = train_draft(train_config("eagle3", "run-widen", steps=0, init_from=str(original.out),
                                     intermediate_size=width + 24))
    after = load_file(str(wider.out / "model.safetensors"))
    assert after[down].shape[1] == after[gate].shape[0] == width + 24
    assert torch.equal(after[down][:, :width], before[down]) and not after[down][:, width:].any()
    assert torch.equal(after[gate][:width], before[gate]) and after[gate][width:].abs().sum() > 0
    assert load_eagle3_checkpoint(wider.out).config.llama_config.intermediate_size == width + 24
    as_saved = train_draft(train_config("eagle3", "run-as-saved", steps=0, init_from=str(original.out)))
    for metric, value in as_saved.summary["heldout"].items():  # the saved (bf16) head, scored the same way
        assert wider.summary["heldout"][metric] == pytest.approx(value, abs=1e-4), metric
    with pytest.raises(ValueError, match="widened, not narrowed"):
        train_draft(train_config("eagle3", "run-narrow", steps=0, init_from=str(original.out),
                                 intermediate_size=width - 8))
