"""Suffix-automaton drafting (SA) and the SA enhancer on heads (use_sa_spec): lossless, drafts where the text
repeats and none elsewhere, sampling keeps the target's distribution, bad settings refused in one line."""
import pytest
from pydantic import ValidationError

from tllm_spec import Eagle3Config, MTPConfig, SAConfig, SamplingParams
from tllm_spec.spec_model import SpecModel

from ..models import assert_greedy_lossless, family_grid, hf_greedy, tiny_pair

# the first repeats its opening; tiny random targets' greedy continuations fall into loops, which SA then drafts
PROMPTS = [[5, 17, 3, 44, 9, 2, 71, 5, 17, 3, 44], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
MAX_NEW = [40, 30, 37]
FAST = {("llama", 1), ("qwen2", 4), ("qwen3", 8), ("mistral", 4)}


def check_lossless(target, model, prompts=PROMPTS, max_new=MAX_NEW):
    return assert_greedy_lossless(target, model, prompts, max_new)


@pytest.mark.parametrize("arch,k", family_grid((1, 4, 8), FAST))  # one K per family in the README command
def test_sa_is_lossless_and_accepts_drafts_where_the_output_repeats(arch, k):
    target, _ = tiny_pair(arch)
    model = SpecModel.from_pretrained(target, SAConfig(max_draft_len=k), max_batch_size=3)
    outs = check_lossless(target, model)
    assert sum(outs.stats["histogram"][1:]) > 0  # some step accepted a draft (histogram: by drafts accepted)


@pytest.mark.parametrize("batch", [1, 2])
def test_sa_with_chunked_prefill_and_a_fixed_ngram(batch):
    target, _ = tiny_pair("qwen3")
    prompts = [[9, 8, 7, 6, 5] * 6 + [1, 2], [4, 4, 3], [50 + i % 7 for i in range(29)]]
    model = SpecModel.from_pretrained(target, SAConfig(max_draft_len=6, max_matching_ngram_size=2),
                                      max_batch_size=batch, max_num_batched_tokens=7)
    check_lossless(target, model, prompts, [20, 15, 25])


def test_a_request_without_a_match_verifies_no_drafts():
    # no 50-token suffix ever repeats here: every step emits exactly the target's one token
    target, _ = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, SAConfig(max_draft_len=4, max_matching_ngram_size=50),
                                      max_batch_size=3)
    outs = check_lossless(target, model)
    assert outs.stats["histogram"][1:] == [0] * 4  # no step accepted a draft


def test_the_prompt_is_drafted_from():
    # greedy output that copies the prompt: with the prompt repeated twice, SA drafts its third repetition
    target, _ = tiny_pair("llama")
    loop = hf_greedy(target, [12, 8], 30)[14:20]  # a span the target's greedy output cycles through
    prompt = [12, 8] + loop * 3
    expected = hf_greedy(target, prompt, 24)
    model = SpecModel.from_pretrained(target, SAConfig(max_draft_len=8), max_batch_size=1)
    out = model.generate([prompt], SamplingParams(max_new_tokens=24))[0]
    assert out.token_ids == expected
    if expected[:len(loop)] == loop:  # the target continues the loop: SA's drafts are exactly that
        assert out.stats.accepted_per_step[1] > 1


@pytest.mark.parametrize("spec", [pytest.param("eagle3", marks=pytest.mark.slow),  # three seconds each
                                  pytest.param("mtp_eagle", marks=pytest.mark.slow), "mtp_vanilla"])
def test_sa_on_top_of_a_head_is_lossless_and_drafts_more_where_text_repeats(spec):
    from ..test_mtp_lossless import mtp_target

    if spec == "eagle3":
        target, head = tiny_pair("llama")
        base = Eagle3Config(speculative_model=str(head), max_draft_len=3)
    else:
        target = mtp_target("llama", "deepseek")
        base = MTPConfig(num_nextn_predict_layers=3, use_mtp_vanilla=spec == "mtp_vanilla")
    plain = check_lossless(target, SpecModel.from_pretrained(target, base, max_batch_size=3))
    enhanced = SpecModel.from_pretrained(target, base.model_copy(update=dict(use_sa_spec=True, sa_spec_threshold=2)),
                                         max_batch_size=3)
    outs = check_lossless(target, enhanced)
    assert outs.stats["mean_accepted_length"] > plain.stats["mean_accepted_length"]


@pytest.mark.slow  # ten seconds or more on the 2-core CI machine
@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_sa_on_a_tree_puts_its_chain_on_the_first_children(tree):
    from tllm_spec.drafts.tree import DEFAULT_EAGLE_CHOICES

    target, head = tiny_pair("llama")
    fields = dict(eagle_choices=DEFAULT_EAGLE_CHOICES, max_draft_len=7) if tree == "static" else dict(
        use_dynamic_tree=True, dynamic_tree_max_topK=3, max_total_draft_tokens=25, max_draft_len=8)
    base = Eagle3Config(speculative_model=str(head), **fields)
    plain = check_lossless(target, SpecModel.from_pretrained(target, base, max_batch_size=3))
    enhanced = SpecModel.from_pretrained(target, base.model_copy(update=dict(use_sa_spec=True, sa_spec_threshold=2)),
                                         max_batch_size=3)
    outs = check_lossless(target, enhanced)
    assert outs.stats["mean_accepted_length"] > plain.stats["mean_accepted_length"]
    # a sampled request beside greedy ones keeps its head's tree (drawn children, rejection sampling)
    sampled = enhanced.generate(PROMPTS, [SamplingParams(max_new_tokens=12),
                                          SamplingParams(max_new_tokens=12, temperature=1.0, seed=3),
                                          SamplingParams(max_new_tokens=12)])
    assert sampled[0].token_ids == hf_greedy(target, PROMPTS[0], 12) and len(sampled[1].token_ids) == 12


def test_first_child_chains_follow_each_trees_most_likely_children():
    import torch

    from tllm_spec.drafts.tree import DraftTree, first_child_chains

    static = DraftTree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])  # nodes 1 .. 6
    parents = torch.tensor([static.parents, [0, 0, 0, 2, 2, 3, 1]])  # the second: node 6 is node 1's only child
    assert first_child_chains(parents, 4).tolist() == [[1, 3, 6, 0], [1, 6, 0, 0]]


@pytest.mark.parametrize("spec", ["sa", pytest.param("eagle3+sa", marks=pytest.mark.slow)])
def test_sampled_output_keeps_the_targets_distribution(spec):
    from ..sampling.test_distribution import V, exact_joint, pvalue, sample_pairs

    target, head = tiny_pair("llama", vocab_size=V, seed=4)
    cfg = SAConfig(max_draft_len=3) if spec == "sa" else Eagle3Config(
        speculative_model=str(head), max_draft_len=3, use_rejection_sampling=True, use_sa_spec=True,
        sa_spec_threshold=1)
    model = SpecModel.from_pretrained(target, cfg, max_batch_size=64)
    counts, stats = sample_pairs(model, 1.0, seed=11)
    assert pvalue(counts, exact_joint(target, 1.0)) > 1e-3
    assert pvalue(counts, exact_joint(target, 0.6)) < 1e-4  # the check has power
    # drafts were verified and some accepted (SA drafts where the prompt's tokens recur: a few percent of steps)
    assert stats["acceptance_rate_per_position"][0] > 0.005


@pytest.mark.parametrize("kind", ["draft_lm", "sa", "eagle3+sa"])
def test_sixteen_requests_at_once_are_lossless(kind):
    from tllm_spec import DraftTargetConfig

    from ..models import tiny_draft_lm

    target, head = tiny_pair("qwen2")
    cfg = {"draft_lm": DraftTargetConfig(speculative_model=str(tiny_draft_lm("qwen2")), max_draft_len=5),
           "sa": SAConfig(max_draft_len=6),
           "eagle3+sa": Eagle3Config(speculative_model=str(head), max_draft_len=3, use_sa_spec=True,
                                     sa_spec_threshold=2)}[kind]
    prompts = [[(7 * i + j) % 90 + 1 for j in range(3 + i % 5)] * (1 + i % 3) for i in range(16)]
    model = SpecModel.from_pretrained(target, cfg, max_batch_size=16)
    check_lossless(target, model, prompts, [10 + i % 7 for i in range(16)])


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValidationError, match="max_matching_ngram_size 0 is invalid"):
        SAConfig(max_matching_ngram_size=0)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        Eagle3Config(speculative_model="x", use_sa_spec=True, sa_spec_threshold=0)
    from tllm_spec import DraftTargetConfig

    with pytest.raises(ValidationError, match="use_sa_spec"):  # a draft LM's config has no enhancer to host
        DraftTargetConfig(speculative_model="x", use_sa_spec=True)
    with pytest.raises(ValidationError, match="use_sa_spec"):
        SAConfig(use_sa_spec=True)
    with pytest.raises(ValidationError, match="greater than or equal to 1024"):
        SAConfig(enable_global_pool=True, global_pool_size=10)


@pytest.mark.parametrize("pool_size", [1024, 1030])  # 1030: the second text wraps to the pool's start
def test_the_global_pool_drafts_a_repeated_request_from_the_finished_one(pool_size):
    target, _ = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, SAConfig(max_draft_len=4, enable_global_pool=True,
                                                       global_pool_size=pool_size), max_batch_size=2)
    prompt, n = [12, 8, 40, 41, 3], 40
    filler = [[7] * 500 + [9], [1] * 500]  # texts of 500 tokens that push older ones out of a small pool
    first = model.generate([prompt], SamplingParams(max_new_tokens=n))[0]
    model.generate(filler[:1], SamplingParams(max_new_tokens=2))  # the pool now holds both texts
    again = model.generate([prompt], SamplingParams(max_new_tokens=n))[0]
    assert first.token_ids == again.token_ids == hf_greedy(target, prompt, n)
    assert again.stats.accepted_per_step[1:-1] == [5] * (len(again.stats.accepted_per_step) - 2)
    assert again.stats.mean_accepted_length > first.stats.mean_accepted_length
    model.generate(filler, SamplingParams(max_new_tokens=2))  # 1000 more tokens: the first text is evicted
    evicted = model.generate([prompt], SamplingParams(max_new_tokens=n))[0]
    assert evicted.token_ids == first.token_ids
    assert evicted.stats.mean_accepted_length < again.stats.mean_accepted_length
