"""Attention of prompt tokens (eager steps): a packed batch of whole prompts (one
variable-length flash call, or SDPA per run of equal lengths), and a chunk that continues a prompt over its
request's cached K/V (its own keys and the prefix's by two fused calls merged by their log-sum-exp, or SDPA calls
with a lower-right causal bias per block of queries). The CPU's path too: the SDPA kernels read each key in place,
where the paged reference copies a request's keys once per query token (an 1,800-token prompt of the demo target
took 35 s through it, 1.1 s through SDPA, on 2 cores)."""
from __future__ import annotations

import functools
import inspect
import itertools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..kernels.kv_write import from_cache

_QUERY_BLOCK = 2048  # query rows per SDPA call of blocked_causal_attention (a mask of at most this many rows)


def cached_prefix_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, start: int, scale: float,
                            split: bool | None = None, sliding_window: int | None = None,
                            k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of one prompt chunk at positions [start, start + n) over its request's cached K/V at
    positions [0, start + n) (the chunk's own K/V already written): query i sees keys 0 .. start + i.

    q [n, Hq, D]; k_cache, v_cache [num_pages, page_size, Hkv, D]; block_table [1, P] int32 (the request's row,
    on the device: no host sync) -> [n, Hq, D]. The K/V pages are gathered into [Hq, start + n, D] (k, v repeated
    to the query heads: not every SDPA backend takes grouped heads).

    ``split`` (None: where a fused attention kernel returns its log-sum-exp, i.e. on CUDA in bf16/fp16): the chunk
    attends to its own keys by a square causal call and to the prefix by a non-causal call, merged by their
    log-sum-exp (:func:`attention_with_lse`; where neither fused kernel takes the call, the blocked path from then
    on). Both are shapes the fastest kernel takes (cuDNN's on Hopper; a lower-right causal bias goes to flash
    attention at half its speed). Otherwise, and always under a ``sliding_window`` (keys this many positions or
    more below a query are masked), :func:`blocked_causal_attention` (the CPU's path). ``k_scale``, ``v_scale``:
    an FP8 cache's scales (:func:`~..kernels.kv_write.from_cache`)."""
    n, num_q_heads, _ = q.shape
    num_keys, page_size = start + n, k_cache.shape[1]
    pages = block_table[0, :math.ceil(num_keys / page_size)].long()
    group = num_q_heads // k_cache.shape[2]
    k, v = (from_cache(c[pages].flatten(0, 1)[:num_keys], q.dtype, s).transpose(0, 1).repeat_interleave(group, dim=0)
            for c, s in ((k_cache, k_scale), (v_cache, v_scale)))  # [Hq, start + n, D]
    qs = q.contiguous().transpose(0, 1)[None]  # [1, Hq, n, D], dense tokens (q may be a strided slice of q|k|v)
    if split is None:
        split = _LSE_BACKENDS.get(q.device.type) is not None and q.dtype in (torch.bfloat16, torch.float16)
    if split and sliding_window is None:
        try:
            own = attention_with_lse(qs, k[None, :, start:], v[None, :, start:], True, scale)
            before = attention_with_lse(qs, k[None, :, :start], v[None, :, :start], False, scale)
            return merge_by_lse(*own, *before)[0].transpose(0, 1)
        except RuntimeError:  # no fused kernel takes these shapes on this GPU: the lower-right bias from now on
            if _LSE_BACKENDS.pop(q.device.type, None) is None:
                raise
    return blocked_causal_attention(qs, k[None], v[None], start, scale, sliding_window)[0].transpose(0, 1)


def blocked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                             sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of queries at positions [start, start + n) over keys at [0, start + n): query i sees keys
    0 .. start + i (and, with ``sliding_window``, only the last ``sliding_window`` of those). q [B, H, n, D];
    k, v [B, H or Hkv, start + n, D] -> [B, H, n, D].

    Queries go in blocks of at most _QUERY_BLOCK rows, each one SDPA call with a lower-right causal bias (or, with
    a window, an explicit mask over only the keys the block's windows hold): a backend that has to materialise
    the mask (the CPU's) builds [_QUERY_BLOCK, start + n] at most, never [n, start + n]."""
    n = q.shape[2]
    out = q.new_empty(q.shape)
    for first in range(0, n, _QUERY_BLOCK):
        last = min(n, first + _QUERY_BLOCK)
        lo, hi = 0, start + last  # the keys the block reads
        if sliding_window is None:
            mask = causal_lower_right(last - first, hi)
        else:
            lo = max(0, start + first - sliding_window + 1)
            query_pos = torch.arange(start + first, start + last, device=q.device)[:, None]
            key_pos = torch.arange(lo, hi, device=q.device)
            mask = (key_pos <= query_pos) & (key_pos > query_pos - sliding_window)  # [last - first, hi - lo]
        out[:, :, first:last] = F.scaled_dot_product_attention(
            q[:, :, first:last], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1])
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


LONG_PROMPT_TOKENS = 8192  # a lone prompt this long keeps SDPA (its plan is built once per such length)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: tuple[int, ...], scale: float,
                      sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention within each prompt of a packed batch. q [N, Hq, D]; k, v [N, Hkv, D] -> [N, Hq, D].

    One kernel for the whole batch where it can: torch's variable-length flash attention on CUDA (bf16/fp16,
    where this torch has it), else one SDPA call per run of consecutive prompts of equal length. A call per
    prompt would cost each layer of an eager prompt step tens of host microseconds per prompt. A lone prompt
    takes the varlen kernel too below LONG_PROMPT_TOKENS: SDPA's cuDNN kernel builds an execution plan for each
    new length on first use (the first took 1.4 s on an H200), on the request's path."""
    if (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and (len(lens) > 1 or lens[0] < LONG_PROMPT_TOKENS)):
        out = varlen_causal_attention(q, k, v, lens, scale, sliding_window)
        if out is not None:
            return out
    out = torch.empty_like(q)
    start = 0
    for n, count in ((n, len(list(run))) for n, run in itertools.groupby(lens)):  # runs of equal lengths
        rows = slice(start, start + n * count)
        qs, ks, vs = (x[rows].unflatten(0, (count, n)).transpose(1, 2).to(q.dtype) for x in (q, k, v))  # [c, H, n, D]
        if sliding_window is None:  # plain causal keeps the flash kernels eligible
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=qs.shape[1] != ks.shape[1])
        else:  # explicit masks, by blocks of queries
            o = blocked_causal_attention(qs, ks, vs, 0, scale, sliding_window)
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
    written to); copied without waiting for the device (the stream keeps the order)."""
    return torch.tensor((0, *itertools.accumulate(lens)), dtype=torch.int32).to(device, non_blocking=True)


@functools.lru_cache(maxsize=4)
def _key_layout(lens: tuple[int, ...], starts: tuple[int, ...], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(each key's chunk [K] int64, each key's position [K] int64) of chunks whose keys are positions
    [0, start + n) of their request, back to back: built once per step's chunk shapes, on the device."""
    chunk = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor([s + n for s, n in zip(starts, lens)]))
    position = torch.cat([torch.arange(s + n) for s, n in zip(starts, lens)])
    return chunk.to(device, non_blocking=True), position.to(device, non_blocking=True)


def chunks_over_cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, chunk_slots: torch.Tensor, lens: tuple[int, ...],
                                starts: tuple[int, ...], scale: float, sliding_window: int | None = None,
                                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor | None:
    """Every prompt chunk's causal attention over its request's cached K/V at positions [0, start + n) (its own
    K/V already written) in one variable-length flash call: each chunk's keys gathered from its pages, the
    causal mask aligned to the keys' end. q [sum(lens), Hq, D], chunks back to back; chunk_slots [C] int64
    (block-table rows, on the device) -> [sum(lens), Hq, D]. None where :func:`varlen_causal_attention` is.
    Shape-agnostic, so a step of new chunk lengths builds no plan, and one call serves every chunk (a cache hit's
    requests join a step together). ``k_scale``, ``v_scale``: an FP8 cache's scales."""
    chunk, position = _key_layout(lens, starts, q.device)
    page_size = k_cache.shape[1]
    pages = block_tables.index_select(0, chunk_slots)[chunk, position // page_size].long()
    flat = pages * page_size + position % page_size
    k, v = (from_cache(c.flatten(0, 1).index_select(0, flat), q.dtype, s) for c, s in ((k_cache, k_scale),
                                                                                      (v_cache, v_scale)))
    return varlen_causal_attention(q, k, v, lens, scale, sliding_window,
                                   tuple(s + n for s, n in zip(starts, lens)))


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: tuple[int, ...],
                            scale: float, sliding_window: int | None = None,
                            key_lens: tuple[int, ...] | None = None) -> torch.Tensor | None:
    """:func:`prefill_attention` as one variable-length flash-attention call (CUDA, bf16/fp16), or None where this
    torch cannot take these arguments (no ``varlen_attn``, or one without the scale or sliding window asked for;
    grouped K/V heads are repeated for a version that does not take them). ``key_lens``: keys per sequence where
    they outnumber its queries (a chunk over its cached prefix: the causal mask aligned to the last key)."""
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
    key_lens = key_lens or lens
    cu_q, cu_k = _cumulative_lengths(lens, q.device), _cumulative_lengths(key_lens, q.device)
    return varlen_attn(q, k, v, cu_q, cu_k, max(lens), max(key_lens), **kwargs)
