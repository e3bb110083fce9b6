"""Rejection sampling: emitted tokens follow the target distribution; invariants; end to end."""
import pytest
import torch

from tllm_spec import Eagle3Config, SamplingParams
from tllm_spec.sampling.rejection import full_vocab_probs, rejection_sample_ref
from tllm_spec.sampling.sampler import target_probs
from tllm_spec.spec_model import SpecModel

from ..models import hf_greedy, tiny_pair
from .test_distribution import exact_joint, pvalue, sample_pairs

V, N = 8, 20000


def dist(logits, temp=1.0, top_k=V, top_p=1.0):
    return target_probs(torch.tensor([logits]), torch.tensor([temp]), torch.tensor([top_k], dtype=torch.int32),
                        torch.tensor([top_p]))[0]


P0 = dist([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
P1 = dist([0.0, 2.5, -1.0, 1.0, 0.3, 0.3, -2.0, 1.2])
P2 = dist([1.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.5, 0.0])


def draws(q, n, seed):
    return torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(seed))


def first_two_tokens(p_rows, q_rows, seed):
    """Emitted (t1, t2) over N independent K=2 steps; when only one token is emitted, a second K=1 step
    (fresh draft from q_rows[1]) emits t2, as the engine's next step would. Context-free target rows."""
    p = torch.stack(p_rows)[None].expand(N, 3, V).contiguous()
    q = torch.stack(q_rows)[None].expand(N, 2, V).contiguous()
    d = torch.stack([draws(q_rows[0], N, seed), draws(q_rows[1], N, seed + 1)], 1)
    tokens, n = rejection_sample_ref(p, q, d, torch.tensor([seed]), torch.tensor([0]))
    d2 = draws(q_rows[1], N, seed + 2)[:, None]
    again, _ = rejection_sample_ref(p[:, 1:], q[:, 1:], d2, torch.tensor([seed + 3]), torch.tensor([0]))
    second = torch.where(n >= 2, tokens[:, 1], again[:, 0])
    return tokens[:, 0], second, n


def chi2_p(samples_a, samples_b, expected):
    counts = torch.zeros(V, V)
    counts.index_put_((samples_a, samples_b), torch.ones(len(samples_a)), accumulate=True)
    return pvalue(counts, expected)


@pytest.mark.parametrize("case", ["near", "far", "restricted"])
def test_emitted_tokens_follow_target(case):
    p0, p1, p2 = P0, P1, P2
    if case == "restricted":  # top-k / top-p restricted targets
        p0 = dist([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2], top_k=3)
        p1 = dist([0.0, 2.5, -1.0, 1.0, 0.3, 0.3, -2.0, 1.2], top_p=0.7)
    q0, q1 = {"near": (dist([2.1, 0.9, 0.5, 0.1, -0.5, -1.0, 1.4, 0.2]), dist([0.0, 2.3, -1.0, 1.1, 0.3, 0.4, -2.0, 1.0])),
              "far": (dist([-2.0, 0.0, 3.0, 0.0, 1.0, 2.0, -1.0, 0.0]), P2),
              "restricted": (P1, P0)}[case]
    t1, t2, n = first_two_tokens([p0, p1, p2], [q0, q1], seed=11)
    assert chi2_p(t1, t2, p0[:, None] * p1[None]) > 1e-3
    # the same check rejects the draft's distribution: the test has power
    assert chi2_p(t1, t2, q0[:, None] * q1[None]) < 1e-6
    if case == "near":
        assert n.float().mean() > 2.5  # close drafts mostly survive


def test_identical_distributions_accept_every_draft():
    p = P0[None, None].expand(500, 4, V).contiguous()
    d = draws(P0, 1500, 3).view(500, 3)
    _, n = rejection_sample_ref(p, p[:, :3].contiguous(), d, torch.tensor([1]), torch.tensor([0]))
    assert (n == 4).all()


def test_disjoint_supports_accept_nothing():
    p = torch.zeros(500, 4, V)
    p[..., :4] = 0.25
    q = torch.zeros(500, 3, V)
    q[..., 4:] = 0.25
    d = torch.randint(4, 8, (500, 3))
    tokens, n = rejection_sample_ref(p, q, d, torch.tensor([1]), torch.tensor([0]))
    assert (n == 1).all() and (tokens[:, 0] < 4).all()


def test_full_vocab_probs_maps_through_d2t():
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    full = full_vocab_probs(probs, torch.tensor([1, 2, 4]), 8)
    assert torch.equal(full, torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.0, 0.0, 0.2, 0.0]]))


def _model(k, max_batch_size=64, draft_vocab_size=None):
    target, head = tiny_pair("llama", vocab_size=V, seed=4, draft_vocab_size=draft_vocab_size)
    cfg = Eagle3Config(speculative_model=str(head), max_draft_len=k, use_rejection_sampling=True)
    return target, SpecModel.from_pretrained(target, cfg, max_batch_size=max_batch_size)


@pytest.mark.parametrize("k,draft_vocab_size", [  # K = 3: three to four seconds each, in the second CI command
    (1, None), pytest.param(3, None, marks=pytest.mark.slow), pytest.param(3, 5, marks=pytest.mark.slow)])
def test_end_to_end_distribution_with_rejection_sampling(k, draft_vocab_size):
    target, model = _model(k, draft_vocab_size=draft_vocab_size)
    counts, stats = sample_pairs(model, 1.0, seed=k)
    assert pvalue(counts, exact_joint(target, 1.0)) > 1e-3
    assert stats["acceptance_rate_per_position"][0] > 0.05


@pytest.mark.slow  # four seconds on the 2-core machine; the sampled tree's keeps seeds in the README command
def test_end_to_end_distribution_with_request_seeds():
    target, model = _model(3)
    counts, stats = sample_pairs(model, 1.0, seed=6, request_seeds=True)
    assert pvalue(counts, exact_joint(target, 1.0)) > 1e-3
    assert stats["acceptance_rate_per_position"][0] > 0.05


def test_greedy_requests_keep_exact_verification():
    target, model = _model(3, max_batch_size=4)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 1, 2], [3, 3, 3]]
    params = [SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=10, temperature=1.0),
              SamplingParams(max_new_tokens=10, top_k=1, temperature=0.7),
              SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9)]
    outs = model.generate(prompts, params, seed=2)
    assert outs[0].token_ids == hf_greedy(target, prompts[0], 10)
    assert outs[2].token_ids == hf_greedy(target, prompts[2], 10)


TREES = {"static": dict(eagle_choices=[[0], [1], [2], [0, 0], [1, 0]]),
         "dynamic": dict(use_dynamic_tree=True, dynamic_tree_max_topK=3, max_total_draft_tokens=5)}


@pytest.mark.parametrize("request_seeds,tree", [  # four to five seconds each on the 2-core machine: the README
    pytest.param(False, "static", marks=pytest.mark.slow),  # command keeps one case, the second CI command the rest
    pytest.param(True, "static", marks=pytest.mark.slow), pytest.param(False, "dynamic", marks=pytest.mark.slow),
    (True, "dynamic")])
def test_end_to_end_distribution_of_a_sampled_tree(request_seeds, tree):
    """A tree of three first drafts (and children) drawn without replacement and verified by recursive rejection
    sampling: the first two emitted tokens (the second through the tree) follow the target's joint distribution.
    The dynamic tree keeps the 5 best-scoring of its 3 + 9 candidates, its shape chosen anew each step."""
    target, head = tiny_pair("llama", vocab_size=V, seed=4)
    cfg = Eagle3Config(speculative_model=str(head), max_draft_len=2, use_rejection_sampling=True, **TREES[tree])
    model = SpecModel.from_pretrained(target, cfg, max_batch_size=64)
    counts, stats = sample_pairs(model, 1.0, seed=8, request_seeds=request_seeds)
    assert pvalue(counts, exact_joint(target, 1.0)) > 1e-3
    assert stats["acceptance_rate_per_position"][0] > 0.05
    assert pvalue(counts, exact_joint(target, 0.6)) < 1e-4  # the check has power
