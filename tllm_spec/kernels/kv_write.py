"""Write one forward's K/V rows into the paged cache at each token's (request slot, position).

The page and offset are found inside the kernel from the block table, so a step needs no index tensor of
its own and the write sits inside a CUDA graph like the attention that follows it.
"""
from __future__ import annotations

import torch

from .. import kernels

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


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor) -> None:
    """Torch reference (the CPU path and the oracle).

    k, v [N, Hkv, D]; k_cache, v_cache [num_pages, page_size, Hkv, D] (written in place); block_tables [S, P]
    int32; token_slots [N] int64 (block-table row of each token); positions [N] int64.
    """
    index = flat_slot_index(block_tables, token_slots, positions, k_cache.shape[1])
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, index, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, index, v.to(v_cache.dtype))


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             block_tables: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor) -> None:
    """The Triton kernel on CUDA, else the reference. Same signature as :func:`kv_write_ref`."""
    if not kernels.runs_kernel(k):
        return kv_write_ref(k, v, k_cache, v_cache, block_tables, token_slots, positions)
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v.shape == k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and block_tables.dtype == torch.int32
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, block_tables, token_slots, positions, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), block_tables.stride(0), PAGE_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), num_warps=1)


if triton is not None:

    @triton.jit
    def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, token_slots_ptr, positions_ptr,
                         k_stride_t, k_stride_h, v_stride_t, v_stride_h, bt_stride, PAGE_SIZE: tl.constexpr,
                         NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
        """One program per (token, KV head): copy its K and V rows (cast to the cache dtype) into the page."""
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
        tl.store(k_cache_ptr + dst + dims, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
        tl.store(v_cache_ptr + dst + dims, v.to(v_cache_ptr.dtype.element_ty), mask=ok)
