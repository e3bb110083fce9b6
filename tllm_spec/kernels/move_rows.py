"""Moving a few rows of the paged KV caches in every layer at once: an accepted draft-tree path's K/V into the
rows a chain would have left (:mod:`..drafts.tree_verify`).

A step's move is the same handful of rows (D+1 per request) in every layer's K and V, so the cost is launches,
not bytes: per layer, a gather and a scatter of K and of V were four launches, 132 of them a step for an 8B
target and its head. Here one launch moves them all: a program per (cache, request) reads the cache's address
from a device table of every cache's address (built once with the caches, so a CUDA graph replays it), loads the
request's rows, waits for the whole program's loads and stores them at their destinations. A path node's
index is never below its depth, so a destination can be another row's source but never the other way round
after it was read: loading every row before storing any keeps the move a gather then a scatter.
"""
from __future__ import annotations

import torch

from .. import kernels
from .kv_write import as_stored

TILE_ELEMENTS = 8192  # a program's rows x columns per load (8 path rows x 1024, 64 rows x 128, ...)

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None


def cache_table(caches: list[torch.Tensor]) -> torch.Tensor:
    """[len(caches)] int64: each cache's address, for :func:`move_rows` (build it once, outside a graph)."""
    return torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=caches[0].device)


def move_rows_ref(caches: list[torch.Tensor], table: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                  width: int) -> None:
    """Torch reference (the CPU path and the oracle), in place: in every cache [num_pages, page_size, ...] (all of
    one shape and dtype), flat row src[i] to flat row dst[i]. src, dst [R * width] int64, ``width`` rows per
    request (the kernel's program); ``table``: :func:`cache_table` of ``caches`` (unused here)."""
    for cache in caches:
        flat = as_stored(cache.view(-1, *cache.shape[2:]))
        flat.index_copy_(0, dst, flat.index_select(0, src))


def move_rows(caches: list[torch.Tensor], table: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
              width: int) -> None:
    """The Triton kernel on CUDA (one launch for every cache), else the reference (same signature)."""
    if not kernels.runs_kernel(caches[0]) or not src.numel():
        return move_rows_ref(caches, table, src, dst, width)
    first = caches[0]
    assert all(c.shape == first.shape and c.dtype == first.dtype and c.is_contiguous() for c in caches)
    assert table.shape == (len(caches),) and src.shape == dst.shape and src.numel() % width == 0
    row, width_pad = first[0, 0].numel(), triton.next_power_of_2(width)
    columns = min(max(TILE_ELEMENTS // width_pad, 16), triton.next_power_of_2(row))
    _move_rows_kernel[(len(caches), src.numel() // width)](
        table, src, dst, ROW=row, COLUMNS=columns, WIDTH=width, WIDTH_PAD=width_pad,
        DTYPE=_TRITON_DTYPES[first.dtype], num_warps=4)


# Under torch.compile the move is a custom op that mutates the caches in place (traced, a write into a view of a
# graph input may be functionalised into a copy of the whole cache)
move_rows_op = torch.library.custom_op("tllm_spec::move_cache_rows", move_rows, mutates_args=("caches",))


if triton is not None:
    _TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
                      torch.float8_e4m3fn: tl.float8e4nv}  # an FP8 KV cache's rows move as they are

    @triton.jit
    def _move_rows_kernel(table_ptr, src_ptr, dst_ptr, ROW: tl.constexpr, COLUMNS: tl.constexpr,
                          WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr, DTYPE: tl.constexpr):
        """Program (cache c, request r): rows src[r * WIDTH + j] -> dst[r * WIDTH + j] of cache c, COLUMNS
        elements at a time, every row's columns loaded before any is stored."""
        cache = tl.load(table_ptr + tl.program_id(0)).to(tl.pointer_type(DTYPE))
        j = tl.arange(0, WIDTH_PAD)
        row_ok = j < WIDTH
        first = tl.program_id(1) * WIDTH
        src = tl.load(src_ptr + first + j, mask=row_ok, other=0).to(tl.int64) * ROW
        dst = tl.load(dst_ptr + first + j, mask=row_ok, other=0).to(tl.int64) * ROW
        for start in tl.static_range(0, ROW, COLUMNS):
            cols = start + tl.arange(0, COLUMNS)
            ok = row_ok[:, None] & (cols < ROW)[None, :]
            rows = tl.load(cache + src[:, None] + cols[None, :], mask=ok)
            tl.debug_barrier()  # every thread's loads done before any store (a destination may be a source)
            tl.store(cache + dst[:, None] + cols[None, :], rows, mask=ok)
            tl.debug_barrier()
