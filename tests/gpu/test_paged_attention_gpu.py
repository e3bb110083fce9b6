"""Triton paged attention vs its torch reference."""
import pytest
import torch

from tllm_spec.kernels.paged_attention import paged_attention, paged_attention_ref

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("num_tokens,hq,hkv,d,page", [(1, 8, 8, 128, 16), (3, 32, 8, 128, 16), (17, 4, 2, 64, 3),
                                                      (111, 6, 2, 64, 32), (5, 28, 4, 128, 1), (4, 16, 2, 80, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 13])
def test_kernel_matches_reference(num_tokens, hq, hkv, d, page, dtype, window):
    torch.manual_seed(num_tokens * 7 + hq)
    num_pages, num_slots, max_pages = 64, 5, 20
    k = torch.randn(num_pages, page, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    block_tables = torch.randint(1, num_pages, (num_slots, max_pages), dtype=torch.int32, device="cuda")
    q = torch.randn(num_tokens, hq, d, device="cuda", dtype=dtype)
    slots = torch.randint(0, num_slots, (num_tokens,), device="cuda")
    positions = torch.randint(0, max_pages * page, (num_tokens,), device="cuda")
    scale = d ** -0.5
    ref = paged_attention_ref(q, k, v, block_tables, slots, positions, scale, max_pages * page, window)
    out = paged_attention(q, k, v, block_tables, slots, positions, scale, max_pages * page, window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_kernel_reads_positions_from_device_inside_a_graph():
    torch.manual_seed(0)
    k = torch.randn(16, 16, 2, 64, device="cuda")
    v = torch.randn_like(k)
    bt = torch.arange(1, 16, dtype=torch.int32, device="cuda")[None].repeat(2, 1)
    q = torch.randn(2, 4, 64, device="cuda")
    slots = torch.tensor([0, 1], device="cuda")
    positions = torch.tensor([3, 10], device="cuda")
    paged_attention(q, k, v, bt, slots, positions, 0.125, 256)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(q, k, v, bt, slots, positions, 0.125, 256)
    for pos in ([3, 10], [40, 200], [0, 239]):
        positions.copy_(torch.tensor(pos))
        graph.replay()
        ref = paged_attention_ref(q, k, v, bt, slots, positions, 0.125, 256)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("query_len,num_runs", [(2, 3), (4, 1), (4, 17), (6, 5)])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (6, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 13])
def test_runs_of_query_tokens_match_reference(query_len, num_runs, hq, hkv, dtype, window):
    """Runs of query_len consecutive positions of one request (a verify step) served by one program each."""
    torch.manual_seed(query_len * 31 + num_runs)
    num_pages, page, d, max_pages = 64, 16, 64, 20
    k = torch.randn(num_pages, page, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    block_tables = torch.randint(1, num_pages, (num_runs, max_pages), dtype=torch.int32, device="cuda")
    starts = torch.randint(0, max_pages * page - query_len, (num_runs,), device="cuda")
    positions = (starts[:, None] + torch.arange(query_len, device="cuda")).flatten()
    slots = torch.arange(num_runs, device="cuda").repeat_interleave(query_len)
    q = torch.randn(num_runs * query_len, hq, d, device="cuda", dtype=dtype)
    args = (q, k, v, block_tables, slots, positions, d ** -0.5, max_pages * page, window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(paged_attention(*args, query_len=query_len).float(),
                               paged_attention_ref(*args).float(), atol=tol, rtol=tol)
