"""The GPU path of a prompt chunk that continues a prompt (cached_prefix_attention, context_attention) equals the
paged reference, which takes any positions. Both are torch ops, so this runs on the CPU: the SDPA backend differs
from the GPU's (flash / memory-efficient there), the gathering, masking and GQA handling are the same code."""
from __future__ import annotations

import pytest
import torch

from tllm_spec.kernels.paged_attention import paged_attention_ref
from tllm_spec.model import prompt_attention
from tllm_spec.model.attention import AttentionMetadata, context_attention
from tllm_spec.model.prompt_attention import cached_prefix_attention
from tllm_spec.model.kv_cache import KVCache

PAGE, HKV, D, SCALE = 4, 2, 16, 0.25


def random_cache(num_requests: int, max_tokens: int, seed: int = 0) -> KVCache:
    """A one-layer cache whose pages hold random K/V, each request's pages scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    pages_per_request = -(-max_tokens // PAGE)
    kv = KVCache([(HKV, D)], 1 + num_requests * pages_per_request, PAGE, num_requests, max_tokens, torch.float32,
                 "cpu")
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g))
    pages = 1 + torch.randperm(num_requests * pages_per_request, generator=g)
    kv.block_tables[:num_requests] = pages.view(num_requests, pages_per_request).to(torch.int32)
    return kv


def cached_kv(kv: KVCache, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V that the cache holds for these tokens ([N, Hkv, D] each): this forward's own k, v."""
    index = kv.write_index(slots, positions)
    return kv.k[0].view(-1, HKV, D)[index], kv.v[0].view(-1, HKV, D)[index]


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("start, n", [(1, 1), (3, 5), (4, 4), (7, 17), (13, 3), (16, 11)])
@pytest.mark.parametrize("query_block, split", [(2048, False), (3, False), (2048, True)])
def test_cached_prefix_attention_matches_paged_reference(group, start, n, query_block, split, monkeypatch):
    """Offsets inside a page, on a page boundary and several pages in; chunks within a page and across several;
    queries in one block and in blocks of 3 (each block's causal mask aligned to its own last key); split: the
    chunk's own keys and the prefix's in two calls, merged by their log-sum-exp (the reference's fp32 ops here,
    a fused kernel's on the GPU)."""
    monkeypatch.setattr(prompt_attention, "_QUERY_BLOCK", query_block)
    kv = random_cache(2, 40)
    q = torch.randn(n, HKV * group, D, generator=torch.Generator().manual_seed(1))
    slots = torch.full((n,), 1)
    positions = torch.arange(start, start + n)
    ref = paged_attention_ref(q, kv.k[0], kv.v[0], kv.block_tables, slots, positions, SCALE, start + n)
    out = cached_prefix_attention(q, kv.k[0], kv.v[0], kv.block_tables[1:2], start, SCALE, split=split)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("split", [False, True])
def test_cached_prefix_attention_reads_only_the_keys_before_each_query(split):
    """Keys past the chunk's last position (a later chunk, rejected drafts) do not leak into its queries."""
    kv = random_cache(1, 32)
    q = torch.randn(5, HKV, D)
    before = cached_prefix_attention(q, kv.k[0], kv.v[0], kv.block_tables[:1], 6, SCALE, split=split)
    kv.k[0].view(-1, HKV, D)[kv.write_index(torch.zeros(3, dtype=torch.int64), torch.arange(11, 14))] = 1e4
    assert torch.equal(cached_prefix_attention(q, kv.k[0], kv.v[0], kv.block_tables[:1], 6, SCALE, split=split),
                       before)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [None, 3])
def test_context_attention_of_mixed_chunks_matches_paged_reference(group, window):
    """A batch of chunks as the engine packs them: a prompt from 0, chunks continuing prompts at offsets that cross
    page boundaries (sliding window: the paged kernel serves those)."""
    lens, starts = (6, 5, 1, 9), (0, 7, 12, 4)
    kv = random_cache(len(lens), 32)
    slots = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    q = torch.randn(sum(lens), HKV * group, D, generator=torch.Generator().manual_seed(2))
    k, v = cached_kv(kv, slots, positions)
    meta = AttentionMetadata.build(kv, slots, positions, 32, lens, context_starts=starts)
    ref = paged_attention_ref(q, kv.k[0], kv.v[0], kv.block_tables, slots, positions, SCALE, 32, window)
    torch.testing.assert_close(context_attention(0, q, k, v, meta, SCALE, window), ref)


@pytest.mark.parametrize("split", [False, True])
def test_cached_prefix_attention_in_bfloat16(split):
    kv = random_cache(1, 40)
    kv.k[0], kv.v[0] = kv.k[0].bfloat16(), kv.v[0].bfloat16()
    q = torch.randn(9, 4 * HKV, D).bfloat16()
    positions = torch.arange(10, 19)
    ref = paged_attention_ref(q, kv.k[0], kv.v[0], kv.block_tables, torch.zeros(9, dtype=torch.int64), positions,
                              SCALE, 19)
    out = cached_prefix_attention(q, kv.k[0], kv.v[0], kv.block_tables[:1], 10, SCALE, split=split)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("takes,window,expected", [
    ({"is_causal"}, None, {"is_causal": True}),  # the first varlen_attn: no scale, grouped heads repeated
    ({"is_causal"}, 3, None),  # nor a sliding window: the SDPA path
    ({"scale", "window_size"}, None, {"scale": 0.25, "window_size": (-1, 0)}),
    ({"scale", "window_size"}, 3, {"scale": 0.25, "window_size": (2, 0)}),
    ({"scale", "window_size", "enable_gqa"}, 3, {"scale": 0.25, "window_size": (2, 0), "enable_gqa": True}),
])
def test_varlen_call_matches_the_torch_version(monkeypatch, takes, window, expected):
    """What ``varlen_causal_attention`` passes to each generation of torch's varlen_attn: causality, the window
    as flash's left extent (window - 1: our mask's key j > i - window), the scale, and K/V heads (grouped, or
    repeated to the query heads)."""
    calls = []

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append((k.shape[1], cu_q.tolist(), max_q, kwargs))
        return q
    monkeypatch.setattr(prompt_attention, "_VARLEN", (varlen_attn, takes))
    q, k = torch.randn(12, 4, 16), torch.randn(12, 2, 16)
    out = prompt_attention.varlen_causal_attention(q, k, k, (5, 7), 0.25, window)
    if expected is None:
        assert out is None and not calls
        return
    heads = 2 if "enable_gqa" in takes else 4
    assert calls == [(heads, [0, 5, 12], 7, expected)]
    assert prompt_attention.varlen_causal_attention(q, k, k, (5, 7), 0.5, window) is None or "scale" in takes


def test_the_compiled_steps_op_takes_a_tree_mask():
    """A draft tree's attention inside the compiled step goes through the write_and_attend custom op (Inductor
    never traces the kernels): with the tree mask it writes the run's K/V and equals the paged reference."""
    g = torch.Generator().manual_seed(3)
    cache = KVCache([(2, 8)], num_pages=8, page_size=4, max_requests=1, max_tokens_per_request=24,
                    dtype=torch.float32, device="cpu")
    slot = cache.allocate(20)
    n, base = 6, 9  # a root and five nodes at rows 9..14
    q, k, v = torch.randn(n, 4, 8, generator=g), torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)
    cache.k[0].normal_(generator=g)
    cache.v[0].normal_(generator=g)
    slots, rows = torch.full((n,), slot), torch.arange(base, base + n)
    tree_mask = torch.tensor([1, 3, 5, 11, 19, 41])  # visibility bits: bit j lets a row see the key j rows below
    k_before, v_before = cache.k[0].clone(), cache.v[0].clone()
    out = torch.ops.tllm_spec.write_and_attend(q, k, v, cache.k[0], cache.v[0], cache.block_tables, slots, slots,
                                               rows, 0.3, 24, 0, n, tree_mask)
    k_ref, v_ref = k_before.clone(), v_before.clone()
    table = cache.block_tables[slot].long()
    flat = table[rows // 4] * 4 + rows % 4
    k_ref.view(-1, 2, 8)[flat], v_ref.view(-1, 2, 8)[flat] = k, v
    assert torch.equal(cache.k[0], k_ref) and torch.equal(cache.v[0], v_ref)
    expected = paged_attention_ref(q, k_ref, v_ref, cache.block_tables, slots, rows, 0.3, 24, None, n,
                                   tree_mask=tree_mask)
    torch.testing.assert_close(out, expected)
    plain = paged_attention_ref(q, k_ref, v_ref, cache.block_tables, slots, rows, 0.3, 24, None, n)
    assert not torch.allclose(out, plain)  # the mask was applied


def test_a_chunk_falls_back_to_the_lower_right_bias_where_no_fused_kernel_takes_it(monkeypatch):
    """Where cuDNN and then flash attention refuse the split path's calls (here: the CPU, which has neither), the
    chunk still gets its attention, through the lower-right bias, and later chunks go there directly."""
    monkeypatch.setitem(prompt_attention._LSE_BACKENDS, "cpu", "cudnn")
    kv = random_cache(2, 40)
    q = torch.randn(11, HKV * 4, D, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(16, 27)
    ref = paged_attention_ref(q, kv.k[0], kv.v[0], kv.block_tables, torch.full((11,), 1), positions, SCALE, 27)
    out = cached_prefix_attention(q, kv.k[0], kv.v[0], kv.block_tables[1:2], 16, SCALE, split=True)
    torch.testing.assert_close(out, ref)
    assert "cpu" not in prompt_attention._LSE_BACKENDS
