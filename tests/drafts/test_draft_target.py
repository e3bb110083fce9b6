"""The draft LM inside the step (DRAFT_TARGET_ONE_MODEL): lossless, a model drafting for itself accepts every
draft, chunked prefill and draft-length schedules keep that, bad drafts are refused in one line."""
import json

import pytest

from tllm_spec import DraftTargetConfig, SamplingParams
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.random_models import save_random_target, target_config

from ..models import assert_greedy_lossless, family_grid, hf_greedy, tiny_draft_lm, tiny_pair

PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6, 7, 8, 9], [33, 34, 35, 36],
           [90, 1, 90, 1, 90]]
MAX_NEW = [14, 9, 17, 5, 12]
FAST = {("llama", 8), ("qwen2", 3), ("qwen3", 1), ("mistral", 3)}


def draft_target(draft, k, **fields):
    return DraftTargetConfig(speculative_model=str(draft), max_draft_len=k, **fields)


def check_lossless(target, model, prompts=PROMPTS, max_new=MAX_NEW):
    return assert_greedy_lossless(target, model, prompts, max_new)


@pytest.mark.parametrize("arch,k", family_grid((1, 3, 8), FAST))  # one K per family in the README command
def test_a_target_drafting_for_itself_is_lossless_and_accepts_every_draft(arch, k):
    target, _ = tiny_pair(arch)
    model = SpecModel.from_pretrained(target, draft_target(target, k), max_batch_size=3)
    outs = check_lossless(target, model, PROMPTS[:3], MAX_NEW[:3])
    for out in outs:  # every step but a request's last (cut by max_new_tokens) accepts all K drafts and the bonus
        assert all(n == k + 1 for n in out.stats.accepted_per_step[:-1]), out.stats.accepted_per_step


@pytest.mark.parametrize("arch,batch", [("llama", 5), ("qwen3", 1), pytest.param("llama", 1, marks=pytest.mark.slow),
                                        pytest.param("qwen3", 5, marks=pytest.mark.slow)])
def test_a_different_small_draft_is_lossless(arch, batch):
    target, _ = tiny_pair(arch)
    model = SpecModel.from_pretrained(target, draft_target(tiny_draft_lm(arch), 3), max_batch_size=batch)
    check_lossless(target, model)


def test_chunked_prefill_keeps_the_draft_cache_whole():
    target, _ = tiny_pair("llama")
    prompts = [list(range(1, 40)), [7] * 23, [3, 4]]
    model = SpecModel.from_pretrained(target, draft_target(target, 3), max_batch_size=3, max_num_batched_tokens=8)
    outs = check_lossless(target, model, prompts, [12, 10, 9])
    for out in outs:
        assert all(n == 4 for n in out.stats.accepted_per_step[:-1])


def test_a_draft_length_schedule_changes_k_with_the_batch():
    target, _ = tiny_pair("qwen2")
    cfg = draft_target(target, 4, draft_len_schedule={1: 4, 2: 2, 4: 0})
    model = SpecModel.from_pretrained(target, cfg, max_batch_size=5)
    check_lossless(target, model)


def test_rejection_sampling_keeps_greedy_requests_exact():
    target, _ = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, draft_target(tiny_draft_lm("llama"), 3, use_rejection_sampling=True),
                                      max_batch_size=3)
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=1.0),
              SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9)]
    outs = model.generate(PROMPTS[:3], params, seed=2)
    assert outs[0].token_ids == hf_greedy(target, PROMPTS[0], 12)
    assert len(outs[1].token_ids) == len(outs[2].token_ids) == 12


@pytest.mark.slow  # ten seconds or more on the 2-core CI machine
@pytest.mark.parametrize("draft", ["self", "other"])
def test_rejection_sampling_two_token_distribution(draft):
    """At T = 1 the first two emitted tokens follow the target's joint distribution (chi-square); drafting for
    itself, a target's drafts are drawn from p itself and always accepted."""
    from ..sampling.test_distribution import V, exact_joint, pvalue, sample_pairs

    target, _ = tiny_pair("llama", vocab_size=V, seed=4)
    draft_dir = target if draft == "self" else tiny_draft_lm("llama", vocab_size=V)
    model = SpecModel.from_pretrained(target, draft_target(draft_dir, 3, use_rejection_sampling=True),
                                      max_batch_size=64)
    counts, stats = sample_pairs(model, 1.0, seed=6)
    assert pvalue(counts, exact_joint(target, 1.0)) > 1e-3
    assert pvalue(counts, exact_joint(target, 0.6)) < 1e-4  # the check has power
    first = stats["acceptance_rate_per_position"][0]
    assert first > 0.99 if draft == "self" else 0.05 < first < 0.95


def test_a_draft_of_another_vocabulary_is_refused_naming_both_sizes(tmp_path):
    target, _ = tiny_pair("llama")
    other = save_random_target(tmp_path / "draft", target_config("llama", vocab_size=120, num_hidden_layers=2))
    with pytest.raises(ValueError, match=r"vocabulary has 120 tokens, the target's 97"):
        SpecModel.from_pretrained(target, draft_target(other, 3))


def test_a_directory_that_is_not_a_causal_lm_is_refused(tmp_path):
    target, head = tiny_pair("llama")
    with pytest.raises(ValueError, match="EAGLE head"):
        SpecModel.from_pretrained(target, draft_target(head, 3))
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 32}))
    with pytest.raises(ValueError, match="not a causal LM"):
        SpecModel.from_pretrained(target, draft_target(tmp_path / "t5", 3))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        SpecModel.from_pretrained(target, draft_target(tmp_path, 3))
