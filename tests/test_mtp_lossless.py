"""MTP lossless greedy: vanilla MTP and MTP-Eagle output == the target's own greedy output (HF generate).

Tiny random Llama / Qwen2 targets carry 3 random MTP modules appended to their checkpoint in one of the
public layouts (an extra safetensors shard + index, as real checkpoints do), loaded through the real loader;
a tiny GLM-4.5-style MoE target (tests/drafts/test_mtp_moe.py) carries MoE MTP modules, experts stored one tensor
per expert.
"""
import functools
import tempfile
from pathlib import Path

import pytest
import torch

from tllm_spec import MTPConfig, SamplingParams
from tllm_spec.drafts.mtp.checkpoint import LAYOUTS
from tllm_spec.drafts.mtp.model import save_random_mtp_weights
from tllm_spec.model.layers import DecoderLayer
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.random_models import save_random_target, target_config

from .drafts.test_mtp_moe import glm4_moe_config
from .models import hf_greedy

PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6, 7, 8, 9], [33, 34, 35, 36],
           [90, 1, 90, 1, 90]]
MAX_NEW = [14, 9, 17, 5, 12]  # requests finish at different steps
MODES = {  # name -> MTPConfig
    "vanilla1": MTPConfig(num_nextn_predict_layers=1, use_mtp_vanilla=True),
    "vanilla2": MTPConfig(num_nextn_predict_layers=2, use_mtp_vanilla=True),
    "vanilla3": MTPConfig(num_nextn_predict_layers=3, use_mtp_vanilla=True),
    "eagle_k1": MTPConfig(num_nextn_predict_layers=1, max_draft_len=1),
    "eagle_k3": MTPConfig(num_nextn_predict_layers=1, max_draft_len=3),
}


@functools.cache
def mtp_target(arch: str, layout: str, vocab_size: int = 97) -> Path:
    root = Path(tempfile.mkdtemp(prefix=f"tllm_spec_mtp_{arch}_{layout}_"))
    config = glm4_moe_config(vocab_size) if arch == "glm4_moe" else target_config(arch, vocab_size=vocab_size)
    save_random_target(root, config, seed=0)
    save_random_mtp_weights(root, 3, layout, seed=1)
    return root


def check_lossless(target, model, prompts, max_new):
    outs = model.generate(prompts, [SamplingParams(max_new_tokens=n) for n in max_new])
    for prompt, n, out in zip(prompts, max_new, outs):
        assert out.token_ids == hf_greedy(target, prompt, n), f"prompt {prompt}"
        assert out.finish_reason == "length"
    return outs


# every mode on both architectures; the layout rotates so each (arch, layout) pair is run
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_lossless_batch3(arch, mode):
    layout = LAYOUTS[(list(MODES).index(mode) + (arch == "qwen2")) % len(LAYOUTS)]
    target = mtp_target(arch, layout)
    model = SpecModel.from_pretrained(target, MODES[mode], max_batch_size=3)
    outs = check_lossless(target, model, PROMPTS[:3], MAX_NEW[:3])
    assert outs.stats["steps"] > 0 and model.max_draft_len == MODES[mode].num_draft_tokens
    assert all(isinstance(m.block, DecoderLayer) for m in model.worker.draft_model.mtp_modules)  # fused blocks


@pytest.mark.parametrize("mode", ["vanilla1", "vanilla3", "eagle_k3"])
def test_greedy_lossless_moe_blocks(mode):
    """GLM-4.5 layout: a MoE target (layer 0 dense) and MoE MTP blocks; an 8-token vocabulary so that drafts are
    sometimes accepted and sometimes not."""
    target = mtp_target("glm4_moe", "deepseek", vocab_size=8)
    model = SpecModel.from_pretrained(target, MODES[mode], max_batch_size=3, device="cpu", dtype=torch.float32)
    outs = check_lossless(target, model, [[t % 8 for t in p] for p in PROMPTS[:3]], MAX_NEW[:3])
    assert {n for o in outs for n in o.stats.accepted_per_step} >= {1, 2}


@pytest.mark.parametrize("mode", ["vanilla3", "eagle_k3"])
def test_more_requests_than_batch_slots_reuse_windows(mode):
    """Finished requests hand their KV slot (and the vanilla window kept for it) to waiting ones."""
    target = mtp_target("qwen2", "deepseek")
    model = SpecModel.from_pretrained(target, MODES[mode], max_batch_size=2)
    check_lossless(target, model, PROMPTS, MAX_NEW)


def test_greedy_requests_unaffected_by_sampled_neighbours():
    target = mtp_target("llama", "mimo")
    model = SpecModel.from_pretrained(target, MODES["vanilla2"], max_batch_size=4)
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=1.0),
              SamplingParams(max_new_tokens=12, top_k=1, temperature=0.7),
              SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, top_k=20)]
    outs = model.generate(PROMPTS[:4], params, seed=3)
    assert outs[0].token_ids == hf_greedy(target, PROMPTS[0], 12)
    assert outs[2].token_ids == hf_greedy(target, PROMPTS[2], 12)
    assert len(outs[1].token_ids) == len(outs[3].token_ids) == 12


@pytest.mark.parametrize("mode", ["vanilla2", "eagle_k3"])
def test_relaxed_acceptance_stays_lossless_when_strict(mode):
    """Relaxed acceptance with top-1 only (greedy) or outside thinking cannot change greedy output."""
    target = mtp_target("llama", "deepseek")
    prompts = [[95, 5, 17, 3], [12, 8, 95, 40, 96, 7]]  # 95 opens thinking, 96 closes it
    for topk, delta in ((1, 0.5), (97, 1.0)):
        cfg = MODES[mode].model_copy(update=dict(
            use_relaxed_acceptance_for_thinking=True, relaxed_topk=topk, relaxed_delta=delta,
            begin_thinking_phase_token=95 if topk == 1 else 94, end_thinking_phase_token=96))
        model = SpecModel.from_pretrained(target, cfg, max_batch_size=2)
        check_lossless(target, model, prompts, [10, 10])


def test_relaxed_acceptance_accepts_everything_while_thinking():
    """topk = vocab, delta = 1: every draft qualifies while thinking, so each step emits K+1 tokens (and the
    output is no longer the target's: lossy by design) until a closing marker is accepted."""
    target = mtp_target("llama", "deepseek")
    cfg = MODES["vanilla3"].model_copy(update=dict(
        use_relaxed_acceptance_for_thinking=True, relaxed_topk=97, relaxed_delta=1.0,
        begin_thinking_phase_token=95, end_thinking_phase_token=96))
    model = SpecModel.from_pretrained(target, cfg, max_batch_size=2)
    prompts = [[95, 5, 17, 3], [5, 17, 3]]  # the second never thinks: strict
    outs = model.generate(prompts, SamplingParams(max_new_tokens=21))
    thinking, plain = outs
    closed_at = thinking.token_ids.index(96) if 96 in thinking.token_ids else len(thinking.token_ids)
    steps_before_close = (closed_at - 1) // 4  # 1 context token, then 4 per step
    assert steps_before_close >= 2
    assert thinking.stats.accepted_per_step[:steps_before_close] == [4] * steps_before_close
    assert thinking.token_ids != hf_greedy(target, prompts[0], 21)
    assert plain.token_ids == hf_greedy(target, prompts[1], 21)


def test_rejection_sampling_keeps_greedy_requests_exact():
    target = mtp_target("qwen2", "mimo")
    model = SpecModel.from_pretrained(target, MODES["vanilla3"].model_copy(update=dict(use_rejection_sampling=True)),
                                      max_batch_size=4)
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=1.0),
              SamplingParams(max_new_tokens=12, top_k=1, temperature=0.7),
              SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9)]
    outs = model.generate(PROMPTS[:4], params, seed=2)
    assert outs[0].token_ids == hf_greedy(target, PROMPTS[0], 12)
    assert outs[2].token_ids == hf_greedy(target, PROMPTS[2], 12)
    assert len(outs[1].token_ids) == len(outs[3].token_ids) == 12


@pytest.mark.parametrize("mode", ["vanilla2", pytest.param("eagle_k3", marks=pytest.mark.slow)])  # 4-5 s
def test_rejection_sampling_two_token_distribution(mode):
    """At T = 1 the first two emitted tokens follow the target's joint distribution (chi-square)."""
    from .sampling.test_distribution import V, exact_joint, pvalue, sample_pairs

    target = mtp_target("llama", "deepseek", vocab_size=V)
    cfg = MODES[mode].model_copy(update=dict(use_rejection_sampling=True))
    model = SpecModel.from_pretrained(target, cfg, max_batch_size=64)
    counts, stats = sample_pairs(model, 1.0, seed=5)
    assert pvalue(counts, exact_joint(target, 1.0)) > 1e-3
    assert stats["acceptance_rate_per_position"][0] > 0.05  # drafts were accepted: the accept path ran
    assert pvalue(counts, exact_joint(target, 0.6)) < 1e-4  # the check has power


def test_relaxed_and_rejection_sampling_are_exclusive():
    cfg = MODES["eagle_k3"].model_copy(update=dict(
        use_rejection_sampling=True, use_relaxed_acceptance_for_thinking=True, begin_thinking_phase_token=1,
        end_thinking_phase_token=2))
    with pytest.raises(ValueError, match="exclusive"):
        SpecModel.from_pretrained(mtp_target("llama", "deepseek"), cfg)
