"""Attention for target and draft layers: write K/V into the paged cache, attend over it.

The target's stock HF attention modules reach :func:`hf_attention_forward` through transformers'
``AttentionInterface`` (registered as ``"tllm_spec"``); the metadata travels as the ``tllm_attn`` keyword
argument, which transformers forwards from the model call to every attention function.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from ..kernels.kv_write import kv_write
from ..kernels.paged_attention import paged_attention
from .kv_cache import KVCache
from .prompt_attention import cached_prefix_attention, chunks_over_cache_attention, prefill_attention

ATTN_IMPLEMENTATION = "tllm_spec"


@dataclass(frozen=True)
class AttentionMetadata:
    """Where one forward's tokens sit in the cache.

    positions [N] int64; token_slots [N] int64 (block-table row per token); write_slots [N] int64 or None
    (the row each token's K/V is written through, when it differs from token_slots: the padding slot sends a
    write to the scratch page). Host values, fixed when the step is built (never read back from the device):
    ``context_lens``, the prompt tokens of each context request in this forward (a whole prompt or a chunk of
    it), which come first; ``context_starts``, the position of each one's first token (empty: all 0): a chunk
    from 0 attends only to itself, a later chunk also to its request's cached K/V before it;
    ``max_kv_len``, a bound on positions + 1 (limits the reference's work);
    ``tokens_per_request``, how many consecutive non-context tokens share a request (K+1 in a step's verify
    rows, 1 in a draft pass): the GPU kernel reads each request's K/V once for all of them.
    A draft tree's tokens (``tree_mask`` set) sit at consecutive cache rows (``positions``) but are rotated by
    their depth (``rope_positions``) and see only their own path (the reference path only, for now).
    """

    kv_cache: KVCache
    positions: torch.Tensor
    token_slots: torch.Tensor
    max_kv_len: int
    context_lens: tuple[int, ...] = ()
    write_slots: torch.Tensor | None = None
    tokens_per_request: int = 1
    context_starts: tuple[int, ...] = ()
    rope_positions: torch.Tensor | None = None  # [N] RoPE position per token where it differs from its cache row
    tree_mask: torch.Tensor | None = None  # [N] int64: a draft tree's visibility per token (paged_attention_ref)

    def with_tree(self, rope_positions: torch.Tensor, tree_mask: torch.Tensor) -> AttentionMetadata:
        """This metadata for a draft tree's tokens (see the class): every field named, not copied through vars(),
        at which torch 2.11's Dynamo broke the compiled step's graph and compiled the dataclass's generated
        ``__init__`` as a frame of its own, whose source the trace cache cannot name."""
        return AttentionMetadata(self.kv_cache, self.positions, self.token_slots, self.max_kv_len, self.context_lens,
                                 self.write_slots, self.tokens_per_request, self.context_starts, rope_positions,
                                 tree_mask)

    @property
    def rotary_positions(self) -> torch.Tensor:
        """The positions RoPE rotates by: ``positions`` (each token's cache row), or a draft tree's own (nodes of
        one depth share a position but not a row)."""
        return self.positions if self.rope_positions is None else self.rope_positions

    @classmethod
    def build(cls, kv_cache: KVCache, token_slots: torch.Tensor, positions: torch.Tensor, max_kv_len: int,
              context_lens: tuple[int, ...] = (), tokens_per_request: int = 1,
              context_starts: tuple[int, ...] = ()) -> AttentionMetadata:
        return cls(kv_cache, positions, token_slots, max_kv_len, tuple(context_lens),
                   tokens_per_request=tokens_per_request, context_starts=tuple(context_starts))

    @property
    def num_context_tokens(self) -> int:
        return sum(self.context_lens)

    @property
    def chunk_starts(self) -> tuple[int, ...]:
        """The position of each context request's first token in this forward (0: a prompt's start)."""
        return self.context_starts or (0,) * len(self.context_lens)

    def for_tokens(self, token_slots: torch.Tensor, positions: torch.Tensor) -> AttentionMetadata:
        """Metadata for one new token per request (a draft step), same bounds, no context part."""
        return AttentionMetadata.build(self.kv_cache, token_slots, positions, self.max_kv_len)


# a KV layer: its index in the cache, or its (k, v) tensors and (an FP8 cache's) per-tensor (k, v) scales
KVLayer = int | tuple[torch.Tensor, torch.Tensor, float, float]


def layer_caches(cache: KVCache, layer: KVLayer) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """(k_cache, v_cache, k_scale, v_scale) of a KV layer given by index or already as its tensors and scales."""
    return layer if isinstance(layer, tuple) else (cache.k[layer], cache.v[layer], *cache.scales(layer))


def attend(layer: KVLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
           scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Store k, v for this forward's tokens in ``layer`` (its index in ``meta.kv_cache``, or its (k_cache,
    v_cache) tensors) and attend. q [N, Hq, D]; k, v [N, Hkv, D] -> [N, Hq, D].

    Context tokens go through :func:`context_attention` (SDPA per prompt chunk, over the request's cached prefix
    for a chunk that continues a prompt) and the other tokens read the paged cache. The CPU too: the paged
    reference copies a request's keys once per query token, so a long prompt through it froze every running
    stream for tens of seconds; it stays the CPU's path for generation tokens and draft trees, and the oracle.
    Under torch.compile the write and the paged attention are one custom op, opaque to Inductor.
    """
    cache = meta.kv_cache
    k_cache, v_cache, k_scale, v_scale = layer_caches(cache, layer)
    num_ctx = meta.num_context_tokens
    write_slots = meta.token_slots if meta.write_slots is None else meta.write_slots
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()  # the kernel takes dense heads (its tokens may have a stride: a slice of qkv)
    if num_ctx == 0 or meta.tree_mask is not None:
        op = torch.ops.tllm_spec.write_and_attend if torch.compiler.is_compiling() else write_and_attend
        query_len = meta.tokens_per_request if num_ctx == 0 else 1  # prompts are not runs of K+1 tokens
        return op(q, k, v, k_cache, v_cache, cache.block_tables, meta.token_slots, write_slots,
                  meta.positions, scale, meta.max_kv_len, sliding_window or 0, query_len, meta.tree_mask,
                  k_scale, v_scale)
    kv_write(k, v, k_cache, v_cache, cache.block_tables, write_slots, meta.positions, k_scale, v_scale)
    out = torch.empty_like(q)
    out[:num_ctx] = context_attention((k_cache, v_cache, k_scale, v_scale), q[:num_ctx], k[:num_ctx], v[:num_ctx],
                                      meta, scale, sliding_window)
    if num_ctx < q.shape[0]:
        out[num_ctx:] = paged_attention(q[num_ctx:], k_cache, v_cache, cache.block_tables,
                                        meta.token_slots[num_ctx:], meta.positions[num_ctx:], scale,
                                        meta.max_kv_len, sliding_window, meta.tokens_per_request,
                                        k_scale=k_scale, v_scale=v_scale)
    return out


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, block_tables: torch.Tensor, token_slots: torch.Tensor,
                     write_slots: torch.Tensor, positions: torch.Tensor, scale: float, max_kv_len: int,
                     sliding_window: int, query_len: int, tree_mask: torch.Tensor | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """kv_write then paged_attention (``sliding_window`` 0 = none; ``tree_mask``: a draft tree's visibility;
    ``k_scale``, ``v_scale``: an FP8 cache's scales).
    q [N, Hq, D] (dense heads; its tokens may have a stride); k, v [N, Hkv, D] -> [N, Hq, D] contiguous. One
    custom op under torch.compile: Inductor never traces into the Triton kernels (a traced kernel's float
    arguments can turn float64)."""
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    if tree_mask is not None:
        kv_write(k, v, k_cache, v_cache, block_tables, write_slots, positions, **scales)
        return paged_attention(q, k_cache, v_cache, block_tables, token_slots, positions, scale, max_kv_len,
                               sliding_window or None, query_len, tree_mask=tree_mask, **scales)
    if write_slots is token_slots:  # the attention kernel writes the run's own K/V
        return paged_attention(q, k_cache, v_cache, block_tables, token_slots, positions, scale, max_kv_len,
                               sliding_window or None, query_len, new_kv=(k, v), **scales)
    kv_write(k, v, k_cache, v_cache, block_tables, write_slots, positions, **scales)
    return paged_attention(q, k_cache, v_cache, block_tables, token_slots, positions, scale, max_kv_len,
                           sliding_window or None, query_len, **scales)


_write_and_attend_op = torch.library.custom_op("tllm_spec::write_and_attend", write_and_attend,
                                               mutates_args=("k_cache", "v_cache"))


@_write_and_attend_op.register_fake
def _(q, k, v, k_cache, v_cache, block_tables, token_slots, write_slots, positions, scale, max_kv_len,
      sliding_window, query_len, tree_mask=None, k_scale=1.0, v_scale=1.0):
    return q.new_empty(q.shape)


SHORT_CHUNK = 2048  # prompt chunks up to this long over cached K/V share one varlen flash call (context_attention)


def context_attention(layer: KVLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                      scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """The context chunks' attention (their K/V already written). q [C, Hq, D]; k, v [C, Hkv, D] -> [C, Hq, D],
    C = meta.num_context_tokens. A chunk from position 0 attends to itself (dense causal SDPA on this forward's
    k, v); a chunk from p > 0 to its request's cached positions [0, p + n) (:func:`cached_prefix_attention`, or
    on the GPU the paged kernel under a sliding window). On the GPU in bf16/fp16, when some chunk continues its
    prompt and none is longer than SHORT_CHUNK (a prefix cache hit's remainder, a conversation's next turn),
    every chunk in one variable-length flash call over keys gathered from the pages
    (:func:`chunks_over_cache_attention`: no call per request, no cuDNN plan per new shape); a long chunk keeps
    cuDNN's two calls, whose attention runs about twice as fast as flash attention's with a lower-right bias."""
    starts = meta.chunk_starts
    if not any(starts):
        return prefill_attention(q, k, v, meta.context_lens, scale, sliding_window)
    cache = meta.kv_cache
    k_cache, v_cache, k_scale, v_scale = layer_caches(cache, layer)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and max(meta.context_lens) <= SHORT_CHUNK:
        firsts = torch.tensor(list(itertools.accumulate((0, *meta.context_lens[:-1]))), dtype=torch.int64)
        slots = meta.token_slots.index_select(0, firsts.to(q.device, non_blocking=True))
        out = chunks_over_cache_attention(q, k_cache, v_cache, cache.block_tables, slots, meta.context_lens,
                                          starts, scale, sliding_window, **scales)
        if out is not None:
            return out
    out = torch.empty_like(q)
    offset = 0
    for n, start in zip(meta.context_lens, starts):
        rows = slice(offset, offset + n)
        if start == 0:
            out[rows] = prefill_attention(q[rows], k[rows], v[rows], (n,), scale, sliding_window)
        elif sliding_window is not None and q.is_cuda:  # the GPU keeps its paged kernel under a window
            out[rows] = paged_attention(q[rows], k_cache, v_cache, cache.block_tables,
                                        meta.token_slots[rows], meta.positions[rows], scale, meta.max_kv_len,
                                        sliding_window, **scales)
        else:
            block_table = cache.block_tables.index_select(0, meta.token_slots[offset:offset + 1])  # [1, P]
            out[rows] = cached_prefix_attention(q[rows], k_cache, v_cache, block_table, start, scale,
                                                sliding_window=sliding_window, **scales)
        offset += n
    return out


@torch.compiler.disable  # compiled decoder layers call into our kernels eagerly: one graph for all layers
def hf_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         tllm_attn: AttentionMetadata | None = None, sliding_window: int | None = None,
                         **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry. query [1, Hq, T, D]; key, value [1, Hkv, T, D] (packed batch)
    -> ([1, T, Hq, D], None). The HF mask is ignored: causality comes from positions."""
    if tllm_attn is None:
        raise RuntimeError("tllm_spec attention called without tllm_attn metadata; run the model through SpecModel")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                 tllm_attn, scale, sliding_window)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, hf_attention_forward)
