"""Attention for target and draft layers: write K/V into the paged cache, attend over it.

The target's stock HF attention modules reach :func:`hf_attention_forward` through transformers'
``AttentionInterface`` (registered as ``"tllm_spec"``); the metadata travels as the ``tllm_attn`` keyword
argument, which transformers forwards from the model call to every attention function.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface

from ..kernels.kv_write import kv_write
from ..kernels.paged_attention import paged_attention
from .kv_cache import KVCache

ATTN_IMPLEMENTATION = "tllm_spec"
_QUERY_BLOCK = 2048  # query rows per SDPA call of a chunk that continues a prompt


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


KVLayer = int | tuple[torch.Tensor, torch.Tensor]  # a KV layer: its index in the cache, or its (k, v) tensors


def layer_caches(cache: KVCache, layer: KVLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) of a KV layer given by index or already as its tensors."""
    return layer if isinstance(layer, tuple) else (cache.k[layer], cache.v[layer])


def attend(layer: KVLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
           scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Store k, v for this forward's tokens in ``layer`` (its index in ``meta.kv_cache``, or its (k_cache,
    v_cache) tensors) and attend. q [N, Hq, D]; k, v [N, Hkv, D] -> [N, Hq, D].

    On the GPU, context tokens go through :func:`context_attention` (dense causal attention per prompt chunk)
    and the other tokens read the paged cache. On the CPU the paged reference serves every token in one batched
    call (cheaper than a call per short prompt; it takes any positions, so chunks need nothing more). Under
    torch.compile the write and the paged attention are one custom op, opaque to Inductor.
    """
    cache = meta.kv_cache
    k_cache, v_cache = layer_caches(cache, layer)
    num_ctx = meta.num_context_tokens
    write_slots = meta.token_slots if meta.write_slots is None else meta.write_slots
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()  # the kernel takes dense heads (its tokens may have a stride: a slice of qkv)
    if num_ctx == 0 or not q.is_cuda or meta.tree_mask is not None:
        op = torch.ops.tllm_spec.write_and_attend if torch.compiler.is_compiling() else write_and_attend
        query_len = meta.tokens_per_request if num_ctx == 0 else 1  # prompts are not runs of K+1 tokens
        return op(q, k, v, k_cache, v_cache, cache.block_tables, meta.token_slots, write_slots,
                  meta.positions, scale, meta.max_kv_len, sliding_window or 0, query_len, meta.tree_mask)
    kv_write(k, v, k_cache, v_cache, cache.block_tables, write_slots, meta.positions)
    out = torch.empty_like(q)
    out[:num_ctx] = context_attention((k_cache, v_cache), q[:num_ctx], k[:num_ctx], v[:num_ctx], meta, scale, sliding_window)
    if num_ctx < q.shape[0]:
        out[num_ctx:] = paged_attention(q[num_ctx:], k_cache, v_cache, cache.block_tables,
                                        meta.token_slots[num_ctx:], meta.positions[num_ctx:], scale,
                                        meta.max_kv_len, sliding_window, meta.tokens_per_request)
    return out


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, block_tables: torch.Tensor, token_slots: torch.Tensor,
                     write_slots: torch.Tensor, positions: torch.Tensor, scale: float, max_kv_len: int,
                     sliding_window: int, query_len: int, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """kv_write then paged_attention (``sliding_window`` 0 = none; ``tree_mask``: a draft tree's visibility).
    q [N, Hq, D] (dense heads; its tokens may have a stride); k, v [N, Hkv, D] -> [N, Hq, D] contiguous. One
    custom op under torch.compile: Inductor never traces into the Triton kernels (a traced kernel's float
    arguments can turn float64)."""
    if tree_mask is not None:
        kv_write(k, v, k_cache, v_cache, block_tables, write_slots, positions)
        return paged_attention(q, k_cache, v_cache, block_tables, token_slots, positions, scale, max_kv_len,
                               sliding_window or None, query_len, tree_mask=tree_mask)
    if write_slots is token_slots:  # the attention kernel writes the run's own K/V
        return paged_attention(q, k_cache, v_cache, block_tables, token_slots, positions, scale, max_kv_len,
                               sliding_window or None, query_len, new_kv=(k, v))
    kv_write(k, v, k_cache, v_cache, block_tables, write_slots, positions)
    return paged_attention(q, k_cache, v_cache, block_tables, token_slots, positions, scale, max_kv_len,
                           sliding_window or None, query_len)


_write_and_attend_op = torch.library.custom_op("tllm_spec::write_and_attend", write_and_attend,
                                               mutates_args=("k_cache", "v_cache"))


@_write_and_attend_op.register_fake
def _(q, k, v, k_cache, v_cache, block_tables, token_slots, write_slots, positions, scale, max_kv_len,
      sliding_window, query_len, tree_mask=None):
    return q.new_empty(q.shape)


def context_attention(layer: KVLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                      scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """The context chunks' attention (their K/V already written). q [C, Hq, D]; k, v [C, Hkv, D] -> [C, Hq, D],
    C = meta.num_context_tokens. A chunk from position 0 attends to itself (dense causal SDPA on this forward's
    k, v); a chunk from p > 0 to its request's cached positions [0, p + n) (:func:`cached_prefix_attention`, or
    the paged kernel under a sliding window)."""
    starts = meta.chunk_starts
    if not any(starts):
        return prefill_attention(q, k, v, meta.context_lens, scale, sliding_window)
    cache = meta.kv_cache
    k_cache, v_cache = layer_caches(cache, layer)
    out = torch.empty_like(q)
    offset = 0
    for n, start in zip(meta.context_lens, starts):
        rows = slice(offset, offset + n)
        if start == 0:
            out[rows] = prefill_attention(q[rows], k[rows], v[rows], (n,), scale, sliding_window)
        elif sliding_window is not None:
            out[rows] = paged_attention(q[rows], k_cache, v_cache, cache.block_tables,
                                        meta.token_slots[rows], meta.positions[rows], scale, meta.max_kv_len,
                                        sliding_window)
        else:
            block_table = cache.block_tables.index_select(0, meta.token_slots[offset:offset + 1])  # [1, P]
            out[rows] = cached_prefix_attention(q[rows], k_cache, v_cache, block_table, start, scale)
        offset += n
    return out


def cached_prefix_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, start: int, scale: float,
                            split: bool | None = None) -> torch.Tensor:
    """Causal attention of one prompt chunk at positions [start, start + n) over its request's cached K/V at
    positions [0, start + n) (the chunk's own K/V already written): query i sees keys 0 .. start + i.

    q [n, Hq, D]; k_cache, v_cache [num_pages, page_size, Hkv, D]; block_table [1, P] int32 (the request's row,
    on the device: no host sync) -> [n, Hq, D]. The K/V pages are gathered into [Hq, start + n, D] (k, v repeated
    to the query heads: not every SDPA backend takes grouped heads).

    ``split`` (None: where a fused attention kernel returns its log-sum-exp, i.e. on CUDA in bf16/fp16): the chunk
    attends to its own keys by a square causal call and to the prefix by a non-causal call, merged by their
    log-sum-exp (:func:`attention_with_lse`). Both are shapes the fastest kernel takes (cuDNN's on Hopper; a
    lower-right causal bias goes to flash attention at half its speed). Otherwise queries go in blocks of at
    most _QUERY_BLOCK rows, each one SDPA call with a lower-right causal bias: a backend that has to materialise
    the bias builds [_QUERY_BLOCK, start + n] at most, never [n, start + n]."""
    n, num_q_heads, _ = q.shape
    num_keys, page_size = start + n, k_cache.shape[1]
    pages = block_table[0, :math.ceil(num_keys / page_size)].long()
    group = num_q_heads // k_cache.shape[2]
    k, v = (c[pages].flatten(0, 1)[:num_keys].to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
            for c in (k_cache, v_cache))  # [Hq, start + n, D]
    qs = q.transpose(0, 1)[None]  # [1, Hq, n, D]
    if split is None:
        split = _LSE_BACKENDS.get(q.device.type) is not None and q.dtype in (torch.bfloat16, torch.float16)
    if split:
        own = attention_with_lse(qs, k[None, :, start:], v[None, :, start:], True, scale)
        before = attention_with_lse(qs, k[None, :, :start], v[None, :, :start], False, scale)
        return merge_by_lse(*own, *before)[0].transpose(0, 1)
    out = torch.empty_like(q)
    for first in range(0, n, _QUERY_BLOCK):
        last = min(n, first + _QUERY_BLOCK)
        keys = start + last
        o = F.scaled_dot_product_attention(qs[:, :, first:last], k[None, :, :keys], v[None, :, :keys], scale=scale,
                                           attn_mask=causal_lower_right(last - first, keys))
        out[first:last] = o[0].transpose(0, 1)
    return out


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, L, D] in q's dtype, log-sum-exp of each query's scaled scores [B, H, L] fp32) of one attention
    call; q [B, H, L, D], k, v [B, H, S, D] (equal heads); ``causal`` with L == S. On CUDA a fused kernel's own
    log-sum-exp (cuDNN's, else flash attention's: :data:`_LSE_BACKENDS`); elsewhere in fp32 torch ops (the
    reference)."""
    backend = _LSE_BACKENDS.get(q.device.type)
    if backend is None:
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        lse = scores.logsumexp(-1)
        return ((scores - lse[..., None]).exp() @ v.float()).to(q.dtype), lse
    if backend == "cudnn":
        try:
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                     scale=scale)
            return res[0], res[1].reshape(q.shape[:3]).float()
        except RuntimeError:  # a shape or GPU this cuDNN does not take: flash attention from now on
            _LSE_BACKENDS[q.device.type] = "flash"
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1].reshape(q.shape[:3]).float()


def merge_by_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                 ) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each one's (out, log-sum-exp) [.., L, D] / [.., L]:
    each weighted by its share of the softmax mass. In out_a's dtype, computed in fp32."""
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - top)[..., None], torch.exp(lse_b - top)[..., None]
    return ((out_a.float() * wa + out_b.float() * wb) / (wa + wb)).to(out_a.dtype)


def _lse_backends() -> dict[str, str]:
    """Device type -> the fused kernel :func:`attention_with_lse` calls there ("cudnn" where this torch has cuDNN
    attention, else "flash"); none on the CPU (the fp32 reference)."""
    if not torch.cuda.is_available():
        return {}
    if hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention") and torch.backends.cudnn.is_available():
        return {"cuda": "cudnn"}
    return {"cuda": "flash"} if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention") else {}


_LSE_BACKENDS = _lse_backends()


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: tuple[int, ...], scale: float,
                      sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention within each prompt of a packed batch. q [N, Hq, D]; k, v [N, Hkv, D] -> [N, Hq, D].

    One kernel for the whole batch where it can: torch's variable-length flash attention on CUDA (bf16/fp16,
    where this torch has it), else one SDPA call per run of consecutive prompts of equal length. A call per
    prompt would cost each layer of an eager prompt step tens of host microseconds per prompt."""
    if len(lens) > 1 and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        out = varlen_causal_attention(q, k, v, lens, scale, sliding_window)
        if out is not None:
            return out
    out = torch.empty_like(q)
    start = 0
    for n, count in ((n, len(list(run))) for n, run in itertools.groupby(lens)):  # runs of equal lengths
        rows = slice(start, start + n * count)
        qs, ks, vs = (x[rows].unflatten(0, (count, n)).transpose(1, 2).to(q.dtype) for x in (q, k, v))  # [c, H, n, D]
        mask = None
        if sliding_window is not None:  # an explicit mask; plain causal keeps the flash kernels eligible
            pos = torch.arange(n, device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - sliding_window)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=qs.shape[1] != ks.shape[1])
        out[rows] = o.transpose(1, 2).flatten(0, 1)
        start += n * count
    return out


def _varlen_attn():
    """torch's ``varlen_attn`` and the keywords it takes of ``scale``, ``window_size``, ``enable_gqa`` (each came
    in a later torch than the last; its first version takes ``is_causal``); None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, {name for name in ("scale", "window_size", "enable_gqa", "is_causal") if name in params}


_VARLEN = _varlen_attn()


@functools.lru_cache(maxsize=4)
def _cumulative_lengths(lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] int32 on ``device``: built once per step's prompt lengths, not in every layer (never
    written to)."""
    return torch.tensor((0, *itertools.accumulate(lens)), dtype=torch.int32, device=device)


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: tuple[int, ...],
                            scale: float, sliding_window: int | None = None) -> torch.Tensor | None:
    """:func:`prefill_attention` as one variable-length flash-attention call (CUDA, bf16/fp16), or None where this
    torch cannot take these arguments (no ``varlen_attn``, or one without the scale or sliding window asked for;
    grouped K/V heads are repeated for a version that does not take them)."""
    if _VARLEN is None:
        return None
    varlen_attn, takes = _VARLEN
    kwargs: dict = {}
    if "window_size" in takes:
        kwargs["window_size"] = (-1 if sliding_window is None else sliding_window - 1, 0)
    elif sliding_window is None and "is_causal" in takes:
        kwargs["is_causal"] = True
    else:
        return None
    if "scale" in takes:
        kwargs["scale"] = scale
    elif scale != q.shape[-1] ** -0.5:
        return None
    k, v = k.to(q.dtype), v.to(q.dtype)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in takes:
            kwargs["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    cu_seq = _cumulative_lengths(lens, q.device)
    longest = max(lens)
    return varlen_attn(q, k, v, cu_seq, cu_seq, longest, longest, **kwargs)


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
