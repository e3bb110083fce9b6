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


def _long_case(contexts, query_len, hq, hkv, dtype, page=16, d=128):
    """Runs of query_len tokens ending at the given context lengths (one request each), pages shuffled."""
    torch.manual_seed(sum(contexts) + query_len + hq)
    max_pages = -(-max(contexts) // page) + 1
    num_pages = len(contexts) * max_pages + 1
    k = torch.randn(num_pages, page, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    block_tables = (torch.randperm(num_pages - 1, device="cuda")[:len(contexts) * max_pages] + 1).int()
    block_tables = block_tables.view(len(contexts), max_pages)
    ends = torch.tensor(contexts, device="cuda")
    positions = (ends[:, None] - query_len + torch.arange(query_len, device="cuda")).clamp(min=0).flatten()
    slots = torch.arange(len(contexts), device="cuda").repeat_interleave(query_len)
    q = torch.randn(len(positions), hq, d, device="cuda", dtype=dtype)
    return q, k, v, block_tables, slots, positions, d ** -0.5, max_pages * page


@pytest.mark.parametrize("contexts", [[1], [17, 4096], [255, 256, 257, 4000], [32768], [9000, 40, 31000]])
@pytest.mark.parametrize("query_len", [1, 4, 6])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (32, 8), (64, 8)])
def test_split_kv_matches_reference_at_long_context(contexts, query_len, hq, hkv):
    """Split-KV (auto and forced) against the reference: contexts to 32k, page boundaries, mixed lengths in one
    batch, GQA 1, 4 and 8, K = 0, 3 and 5 (query_len K + 1)."""
    args = _long_case(contexts, query_len, hq, hkv, torch.bfloat16)
    ref = paged_attention_ref(*args).float()
    for splits in (None, 1, 7, 64):
        out = paged_attention(*args, query_len=query_len, num_splits=splits).float()
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2, msg=f"num_splits={splits}")


@pytest.mark.parametrize("contexts", [[40], [300, 5000]])
@pytest.mark.parametrize("tree_tokens", [8, 32])
def test_tree_mask_matches_reference(contexts, tree_tokens):
    """A draft tree's verify step: runs of 1 + N tokens with random per-token masks over the 63 keys below each
    (itself always visible), unsplit and split, against the reference."""
    query_len = tree_tokens + 1
    args = _long_case(contexts, query_len, 32, 8, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(tree_tokens)
    tree_mask = torch.randint(0, 2 ** 62, (len(args[0]),), device="cuda", generator=g) | 1
    ref = paged_attention_ref(*args, tree_mask=tree_mask).float()
    assert not torch.allclose(paged_attention_ref(*args).float(), ref, atol=2e-2, rtol=2e-2)  # the mask matters
    for splits in (None, 1, 7):
        out = paged_attention(*args, query_len=query_len, num_splits=splits, tree_mask=tree_mask).float()
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2, msg=f"num_splits={splits}")


def test_one_split_graph_serves_every_context_length():
    """A graph captured with a fixed split count reads each run's length on the device: short and long contexts
    replayed through it match the reference, the fused K/V write included."""
    q, k, v, bt, slots, positions, scale, max_kv = _long_case([20000, 20000], 4, 32, 8, torch.bfloat16)
    new_kv = (torch.randn(len(q), 8, 128, device="cuda", dtype=q.dtype), torch.randn(len(q), 8, 128,
                                                                                       device="cuda", dtype=q.dtype))
    caches = (k.clone(), v.clone())
    paged_attention(q, *caches, bt, slots, positions, scale, max_kv, query_len=4, new_kv=new_kv)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(q, *caches, bt, slots, positions, scale, max_kv, query_len=4, new_kv=new_kv)
    k.copy_(caches[0])  # the warm-up call's writes
    v.copy_(caches[1])
    for ends in ([3, 7], [300, 19999], [5000, 12]):
        positions.copy_((torch.tensor(ends, device="cuda")[:, None] - 3 + torch.arange(4, device="cuda"))
                        .clamp(min=0).flatten())
        graph.replay()
        ref_caches = (k.clone(), v.clone())
        ref = paged_attention_ref(q, *ref_caches, bt, slots, positions, scale, max_kv, new_kv=new_kv)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2, msg=str(ends))
        k.copy_(ref_caches[0])
        v.copy_(ref_caches[1])
        torch.testing.assert_close(caches[0], ref_caches[0], atol=0, rtol=0)
