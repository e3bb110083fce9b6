"""Write one forward's K/V rows into the paged cache at each token's (request slot, position).

The page and offset are found inside the kernel from the block table, so a step needs no index tensor of
its own and the write sits inside a CUDA graph like the attention that follows it. An FP8 (E4M3) cache stores
``x / scale`` clamped to +-448 (``k_scale`` / ``v_scale``: the layer's per-tensor scales, 1.0 unless the checkpoint
gives them); readers multiply by the scale again (:func:`to_cache_ref`).
"""
from __future__ import annotations

import torch

from .. import kernels
from .fp8_quant import FP8, FP8_MAX

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None


def flat_slot_index(block_tables: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor, page_size: int
                    ) -> torch.Tensor:
    """Flat cache row (page * page_size + offset) of each token's K/V. [N] int64 -> [N] int64."""
    pages = block_tables[token_slots, positions // page_size].to(torch.int64)
    return pages * page_size + positions % page_size


def to_cache_ref(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """K or V rows as a cache of ``dtype`` stores them: FP8: x * (1 / scale) in fp32, clamped to +-448, rounded to
    nearest (the kernels' arithmetic); else x in that dtype."""
    if dtype != FP8:
        return x.to(dtype)
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached K or V rows in ``dtype`` (an FP8 cache's times its scale, in fp32 first)."""
    return x.to(dtype) if scale == 1.0 else (x.float() * scale).to(dtype)


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Torch reference (the CPU path and the oracle).

    k, v [N, Hkv, D]; k_cache, v_cache [num_pages, page_size, Hkv, D] (written in place); block_tables [S, P]
    int32; token_slots [N] int64 (block-table row of each token); positions [N] int64; k_scale, v_scale: an FP8
    cache's per-tensor scales (:func:`to_cache_ref`).
    """
    index = flat_slot_index(block_tables, token_slots, positions, k_cache.shape[1])
    for cache, rows, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        as_stored(cache.view(-1, *cache.shape[2:])).index_copy_(0, index, as_stored(to_cache_ref(rows, cache.dtype,
                                                                                                 scale)))


def as_stored(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its bytes for an FP8 tensor (the CPU's index_copy_ takes no FP8 elements; a copy is a copy)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             block_tables: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The Triton kernel on CUDA, else the reference. Same signature as :func:`kv_write_ref`."""
    if not kernels.runs_kernel(k):
        return kv_write_ref(k, v, k_cache, v_cache, block_tables, token_slots, positions, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v.shape == k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and block_tables.dtype == torch.int32
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, block_tables, token_slots, positions, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), block_tables.stride(0), 1.0 / k_scale, 1.0 / v_scale, PAGE_SIZE=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), num_warps=1)


if triton is not None:

    @triton.jit
    def to_cache(x, cache_ptr, inv_scale):
        """x as the cache at ``cache_ptr`` stores it (:func:`to_cache_ref`)."""
        dtype = cache_ptr.dtype.element_ty
        if dtype == tl.float8e4nv:
            return tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0).to(dtype)
        return x.to(dtype)

    @triton.jit
    def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, token_slots_ptr, positions_ptr,
                         k_stride_t, k_stride_h, v_stride_t, v_stride_h, bt_stride, inv_k_scale, inv_v_scale,
                         PAGE_SIZE: tl.constexpr,
                         NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
        """One program per (token, KV head): copy its K and V rows (as the cache stores them) into the page."""
        token = tl.program_id(0)
        head = tl.program_id(1)
        slot = tl.load(token_slots_ptr + token).to(tl.int64)
        pos = tl.load(positions_ptr + token).to(tl.int64)
        page = tl.load(block_tables_ptr + slot * bt_stride + pos // PAGE_SIZE).to(tl.int64)
        dst = ((page * PAGE_SIZE + pos % PAGE_SIZE) * NUM_KV_HEADS + head) * HEAD_DIM
        dims = tl.arange(0, HEAD_DIM_PAD)
        ok = dims < HEAD_DIM
        k = tl.load(k_ptr + token * k_stride_t + head * k_stride_h + dims, mask=ok)
        v = tl.load(v_ptr + token * v_stride_t + head * v_stride_h + dims, mask=ok)
        tl.store(k_cache_ptr + dst + dims, to_cache(k, k_cache_ptr, inv_k_scale), mask=ok)
        tl.store(v_cache_ptr + dst + dims, to_cache(v, v_cache_ptr, inv_v_scale), mask=ok)
