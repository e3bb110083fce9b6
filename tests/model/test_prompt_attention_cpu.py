"""The CPU's prompt path: ``attend`` sends context tokens (whole prompts, and chunks that continue a prompt over its
cached K/V) through SDPA, not the paged reference, and its output equals the paged reference's in fp32 for prompts,
continued chunks, batches mixed with generation rows, grouped K/V heads and sliding windows."""
from __future__ import annotations

import pytest
import torch

from tllm_spec.kernels import paged_attention as paged_attention_module
from tllm_spec.kernels.kv_write import kv_write_ref
from tllm_spec.kernels.paged_attention import paged_attention_ref
from tllm_spec.model import prompt_attention
from tllm_spec.model.attention import AttentionMetadata, attend
from tllm_spec.model.kv_cache import KVCache

PAGE, HKV, D, SCALE, MAX_TOKENS = 4, 2, 16, 0.3, 160

# (context requests as (tokens, first position), generation requests as their first position), each of K+1 = 3 rows
STEPS = {
    "prompts": ([(1, 0), (7, 0), (7, 0), (17, 0), (111, 0)], []),
    "chunk after a cached prefix": ([(13, 22)], []),
    "mixed": ([(9, 0), (6, 17), (111, 40)], [30, 5]),
}
GEN_ROWS = 3


def step_inputs(step: str, group: int) -> tuple[KVCache, AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-layer cache whose pages hold random K/V (the cached prefixes), one slot per request, and a step's
    metadata, q [N, HKV * group, D] and k, v [N, HKV, D] (context tokens first)."""
    context, generation = STEPS[step]
    g = torch.Generator().manual_seed(len(context) * 10 + group)
    cache = KVCache([(HKV, D)], 1 + 5 * MAX_TOKENS // PAGE, PAGE, 5, MAX_TOKENS, torch.float32, "cpu")
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    runs = context + [(GEN_ROWS, p) for p in generation]
    slots = torch.cat([torch.full((n,), cache.allocate(MAX_TOKENS)) for n, _ in runs])
    positions = torch.cat([torch.arange(p, p + n) for n, p in runs])
    meta = AttentionMetadata.build(cache, slots, positions, int(positions.max()) + 1, [n for n, _ in context],
                                   GEN_ROWS if generation else 1, [p for _, p in context])
    num_tokens = positions.numel()
    q = torch.randn(num_tokens, HKV * group, D, generator=g)
    k, v = torch.randn(num_tokens, HKV, D, generator=g), torch.randn(num_tokens, HKV, D, generator=g)
    return cache, meta, q, k, v


@pytest.mark.parametrize("query_block", [2048, 4])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("step", list(STEPS))
def test_attend_on_the_cpu_matches_the_paged_reference(step, group, window, query_block, monkeypatch):
    """Chunks from 0 and from inside a page, a 111-token prompt over blocks of 4 queries (each block's mask aligned
    to its own keys, a window's blocks reading only the keys it holds); the step's K/V written as the reference
    writes them; only the generation rows reach the paged reference."""
    monkeypatch.setattr(prompt_attention, "_QUERY_BLOCK", query_block)
    cache, meta, q, k, v = step_inputs(step, group)
    k_ref, v_ref = cache.k[0].clone(), cache.v[0].clone()
    kv_write_ref(k, v, k_ref, v_ref, cache.block_tables, meta.token_slots, meta.positions)
    expected = paged_attention_ref(q, k_ref, v_ref, cache.block_tables, meta.token_slots, meta.positions, SCALE,
                                   meta.max_kv_len, window)
    reference_rows = []

    def recording_reference(q, *args, **kwargs):
        reference_rows.append(q.shape[0])
        return paged_attention_ref(q, *args, **kwargs)
    monkeypatch.setattr(paged_attention_module, "paged_attention_ref", recording_reference)
    out = attend(0, q, k, v, meta, SCALE, window)
    torch.testing.assert_close(out, expected)
    assert torch.equal(cache.k[0], k_ref) and torch.equal(cache.v[0], v_ref)
    assert sum(reference_rows) == GEN_ROWS * len(STEPS[step][1])


def test_a_continued_chunk_reads_no_cached_key_past_its_own_positions():
    """Rows past a chunk's last position (a later chunk, rejected drafts) hold garbage that must not reach it."""
    cache, meta, q, k, v = step_inputs("chunk after a cached prefix", 3)
    before = attend(0, q, k, v, meta, SCALE).clone()
    index = cache.write_index(meta.token_slots[:4], torch.arange(35, 39))
    cache.k[0].view(-1, HKV, D)[index] = 1e4
    assert torch.equal(attend(0, q, k, v, meta, SCALE), before)
