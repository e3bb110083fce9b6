"""The sliced top-k (a draft tree's children on CUDA) against ``torch.topk``: same values, same indices, same order."""
import pytest
import torch

from tllm_spec.sampling.small_topk import _slice_len, small_topk


@pytest.mark.parametrize("vocab", [32000, 128256, 50257, 32001, 300])  # whole slices x2, a tail x2, one topk
@pytest.mark.parametrize("k", [1, 4, 10])
def test_sliced_top_k_equals_torch_topk(vocab: int, k: int):
    g = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(2, 5, vocab, generator=g)  # continuous values: no ties
    x[1, 2, -3:] = 50.0 + torch.arange(3.0)  # the largest at the end (in a tail where there is one)
    values, indices = small_topk(x, k, sliced=True)
    ref_values, ref_indices = x.topk(k, dim=-1)
    torch.testing.assert_close(values, ref_values, rtol=0, atol=0)
    assert torch.equal(indices, ref_indices)


def test_the_vocabularies_under_test_take_both_paths():
    assert 32000 % _slice_len(32000) == 0 and 128256 % _slice_len(128256) == 0
    assert 50257 % _slice_len(50257) and 32001 % _slice_len(32001)


@pytest.mark.parametrize("vocab", [32000, 32001, 50257])
def test_rows_with_fewer_finite_entries_than_k_give_indices_inside_the_vocabulary(vocab: int):
    """A sampled request's log q is -inf outside its top-k / top-p, a guided one's logits outside the grammar: the
    finite entries come first, then -inf ones, every index a real token."""
    x = torch.full((3, vocab), float("-inf"))
    x[:, [5, 700, vocab - 1]] = torch.tensor([1.0, 3.0, 2.0])
    values, indices = small_topk(x, 8, sliced=True)
    assert indices[:, :3].tolist() == [[700, vocab - 1, 5]] * 3 and values[0, :3].tolist() == [3.0, 2.0, 1.0]
    assert bool((indices < vocab).all()) and bool((values[:, 3:] == float("-inf")).all())
    assert all(len(set(row)) == 8 for row in indices.tolist())  # no index twice
