"""The sliced top-k (a draft tree's children on CUDA) against ``torch.topk``: same values, same indices, same order."""
import pytest
import torch

from tllm_spec.sampling.small_topk import small_topk


@pytest.mark.parametrize("vocab", [32000, 128256, 151669, 300])  # divisible, divisible, padded, one slice
@pytest.mark.parametrize("k", [1, 4, 10])
def test_sliced_top_k_equals_torch_topk(vocab: int, k: int):
    g = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(2, 5, vocab, generator=g)  # continuous values: no ties
    x[1, 2, -3:] = 50.0 + torch.arange(3.0)  # the largest in the last (padded) slice
    values, indices = small_topk(x, k, sliced=True)
    ref_values, ref_indices = x.topk(k, dim=-1)
    torch.testing.assert_close(values, ref_values, rtol=0, atol=0)
    assert torch.equal(indices, ref_indices)


def test_rows_of_minus_infinity_but_k_still_give_the_k_finite_entries():
    x = torch.full((3, 32000), float("-inf"))
    x[:, [5, 700, 31999]] = torch.tensor([1.0, 3.0, 2.0])
    values, indices = small_topk(x, 3, sliced=True)
    assert indices.tolist() == [[700, 31999, 5]] * 3 and values[0].tolist() == [3.0, 2.0, 1.0]
