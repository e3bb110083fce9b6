"""The KV-write kernel against its reference, and the write+attend custom op under torch.compile."""
import pytest
import torch

from tllm_spec.kernels.kv_write import kv_write, kv_write_ref
from tllm_spec.model.attention import write_and_attend

pytestmark = pytest.mark.cuda


def _cache(num_pages, page, heads, dim, dtype):
    k = torch.randn(num_pages, page, heads, dim, device="cuda", dtype=dtype)
    return k, torch.randn_like(k)


@pytest.mark.parametrize("tokens,heads,dim,page", [(1, 1, 16, 4), (3, 2, 64, 16), (17, 8, 128, 16), (111, 3, 80, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_matches_reference(tokens, heads, dim, page, dtype):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    num_pages, slots = 64, 4
    block_tables = torch.randperm(num_pages - 1, device="cuda", generator=g)[:slots * 8].view(slots, 8).int() + 1
    flat = torch.randperm(slots * 8 * page, device="cuda", generator=g)[:tokens]  # distinct (slot, position)
    token_slots, positions = flat // (8 * page), flat % (8 * page)
    k = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.float32, generator=g)
    v = torch.randn_like(k)
    a = _cache(num_pages, page, heads, dim, dtype)
    b = tuple(x.clone() for x in a)
    kv_write(k, v, *a, block_tables, token_slots, positions)
    kv_write_ref(k, v, *b, block_tables, token_slots, positions)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)


def test_write_and_attend_compiles_without_copying_the_cache():
    num_pages, page, heads, dim = 32, 16, 2, 64
    k_cache, v_cache = (torch.zeros(num_pages, page, heads, dim, device="cuda") for _ in range(2))
    block_tables = torch.arange(1, 9, device="cuda", dtype=torch.int32).view(1, 8)
    positions = torch.arange(5, device="cuda")
    slots = torch.zeros(5, dtype=torch.int64, device="cuda")
    q = torch.randn(5, 4, dim, device="cuda")
    k, v = torch.randn(5, heads, dim, device="cuda"), torch.randn(5, heads, dim, device="cuda")

    def step(q, k, v):
        return torch.ops.tllm_spec.write_and_attend(q * 2, k + 1, v, k_cache, v_cache, block_tables, slots, slots,
                                                    positions, 0.125, 128, 0, 5)

    out = torch.compile(step, fullgraph=True)(q, k, v)
    cached = k_cache.clone()
    k_cache.zero_(), v_cache.zero_()
    expected = write_and_attend(q * 2, k + 1, v, k_cache, v_cache, block_tables, slots, slots, positions, 0.125,
                                128, 0, 5)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(cached, k_cache)  # the compiled op wrote the caller's cache in place
