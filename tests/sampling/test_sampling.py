"""Sampling: greedy rows exact, sampled rows follow the renormalised top-k/top-p distribution."""
import pytest
import torch
from scipy.stats import chi2

from tllm_spec.sampling import sampler as sampling

V = 8
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def _draw(logits, temp, top_k, top_p, n_draws=20000, seed=1):
    """n_draws independent samples of one row, drawn as one batch."""
    rows = logits.expand(n_draws, -1)
    seed_t, offset = torch.tensor([seed]), torch.tensor([0])
    return sampling.sample_ref(rows, torch.full((n_draws,), temp), torch.full((n_draws,), top_k, dtype=torch.int32),
                               torch.full((n_draws,), top_p), seed_t, offset)


def _expected(logits, temp, top_k, top_p):
    """Top-k first, renormalise, then the smallest prefix holding >= top_p of that mass."""
    probs = (logits / temp).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    top = torch.zeros(V)
    top[order[:top_k]] = probs[order[:top_k]]
    top = top / top.sum()
    keep = torch.zeros(V, dtype=torch.bool)
    mass = 0.0
    for tok in order[:top_k]:
        if mass >= top_p:
            break
        keep[tok] = True
        mass += top[tok].item()
    top = top * keep
    return top / top.sum()


def _chi2_pvalue(samples, expected):
    counts = torch.bincount(samples, minlength=V).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a filtered-out token"
    exp = expected[support].double() * len(samples)
    stat = ((counts[support] - exp) ** 2 / exp).sum().item()
    return chi2.sf(stat, int(support.sum()) - 1)


@pytest.mark.parametrize("temp,top_k,top_p", [(1.0, V, 1.0), (0.7, V, 1.0), (1.0, 3, 1.0), (1.0, V, 0.8),
                                              (1.3, 5, 0.9), (1.0, 0, 1.0)])
def test_sampled_rows_follow_filtered_distribution(temp, top_k, top_p):
    samples = _draw(LOGITS, temp, top_k, top_p)
    expected = _expected(LOGITS, temp, top_k if top_k > 0 else V, top_p)
    assert _chi2_pvalue(samples, expected) > 1e-3


def test_chi2_check_detects_a_wrong_distribution():
    samples = _draw(LOGITS, 1.0, V, 1.0)
    wrong = _expected(LOGITS, 0.7, V, 1.0)
    assert _chi2_pvalue(samples, wrong) < 1e-6


def test_greedy_rows_exact_argmax_in_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(64, 1000)
    greedy = torch.arange(64) % 2 == 0
    temps = torch.where(greedy, 1.0, 1.5)
    top_ks = torch.where(greedy, 1, 0).to(torch.int32)
    top_ps = torch.ones(64)
    out = sampling.sample_ref(logits, temps, top_ks, top_ps, torch.tensor([3]), torch.tensor([0]))
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy])
    assert (out[~greedy] != logits.argmax(-1)[~greedy]).any()  # sampled rows are not argmax everywhere


@pytest.mark.parametrize("sentinel", [0, -1, 2**31 - 1, V + 5])
def test_top_k_sentinels_disable_filter(sentinel):
    assert sampling.sanitize_top_ks(torch.tensor([sentinel]), V).item() == V
    samples = _draw(LOGITS, 1.0, sentinel, 1.0, n_draws=4000)
    assert samples.unique().numel() == V  # nothing was masked, in particular not the whole row


def test_seed_advances_and_is_reproducible():
    logits = torch.zeros(16, V)
    ones = torch.ones(16)
    k = torch.full((16,), V, dtype=torch.int32)
    seed = torch.tensor([5])
    first = sampling.sample_ref(logits, ones, k, ones, seed, torch.tensor([0]))
    assert seed.item() == 6
    second = sampling.sample_ref(logits, ones, k, ones, seed, torch.tensor([0]))
    again = sampling.sample_ref(logits, ones, k, ones, torch.tensor([5]), torch.tensor([0]))
    assert torch.equal(first, again) and not torch.equal(first, second)


def test_target_probs_matches_expected():
    probs = sampling.target_probs(LOGITS[None], torch.tensor([1.3]), torch.tensor([5], dtype=torch.int32),
                                  torch.tensor([0.9]))
    assert torch.allclose(probs[0], _expected(LOGITS, 1.3, 5, 0.9), atol=1e-6)


def test_greedy_draft_tokens_maps_through_d2t():
    draft_logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    d2t = torch.tensor([2, 4, 7])  # draft id i -> target id i + d2t[i]
    assert sampling.greedy_draft_tokens(draft_logits, d2t).tolist() == [5, 2]
    assert sampling.greedy_draft_tokens(draft_logits, None).tolist() == [1, 0]
