"""Merge of split-KV attention partials by log-sum-exp (the second kernel of :mod:`.paged_attention`'s split path),
and the split geometry both kernels compute on the device from a run's positions.

A run of ``query_len`` query tokens of one request attends to keys ``[lo, last]`` (``last``: its highest position;
``lo``: 0, or the sliding window's first block). Those keys are cut into chunks of whole key blocks, at least
``min_chunk`` long, into as many splits as the launch fills one wave of the GPU with (``wave_splits``) or more where
chunks would pass ``max_chunk`` keys, never more than the launch's ``num_splits``: so a run's split count follows
its own length, not the bound the launch (a CUDA graph) was sized for. Split ``s`` holds ``[lo+s*chunk,
lo+(s+1)*chunk)``, the last used one up to ``last``. A run of fewer than two minimum chunks is never split: its
first split takes all its keys, so at short contexts nothing is merged (a split for a few keys past ``min_chunk``
cost more in the merge than it saved). Split ``s`` leaves acc (unnormalised), max and sum per (token, query head);
the merge rescales each by ``exp(max_s - max)`` and divides. A run that needs one chunk only is finished by its
split 0 and skipped here.
"""
from __future__ import annotations

import torch

from . import dependent_launch

MAX_SPLITS = 64  # a run's keys are split at most this many ways
NO_MAX_CHUNK = 1 << 40  # chunks without an upper bound
SPLITS_PAD = MAX_SPLITS  # the merge's split axis (a power of 2): one compiled merge for every split count

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None


def split_geometry_ref(positions: torch.Tensor, query_len: int, window: int, num_splits: int, min_chunk: int,
                       block_n: int, wave_splits: int | None = None, max_chunk: int = NO_MAX_CHUNK
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per run: (lo, chunk, num_used) [runs] int64, as the kernels compute them. positions [T] int64;
    ``wave_splits`` None: ``num_splits`` (every run that is long enough uses all of them)."""
    runs = -(-positions.numel() // query_len)
    padded = torch.full((runs * query_len,), -1, dtype=torch.int64, device=positions.device)
    padded[:positions.numel()] = positions
    last = padded.view(runs, query_len).max(1).values
    lo = torch.zeros_like(last)
    if window > 0:
        lowest = padded.view(runs, query_len).masked_fill(padded.view(runs, query_len) < 0, 1 << 62).min(1).values
        lo = ((lowest - window + 1).clamp(min=0) // block_n) * block_n
    keys = last + 1 - lo
    splits = torch.clamp(-(-keys // max_chunk), min=wave_splits or num_splits, max=num_splits)
    chunk = -(-(torch.clamp(-(-keys // splits), min=min_chunk)) // block_n) * block_n
    return lo, chunk, torch.where(keys < 2 * min_chunk, 1, -(-keys // chunk))


def merge_splits_ref(part_acc: torch.Tensor, part_ml: torch.Tensor, positions: torch.Tensor, out: torch.Tensor,
                     query_len: int, window: int, block_n: int, min_chunk: int, pdl: bool = False,
                     wave_splits: int | None = None, max_chunk: int = NO_MAX_CHUNK) -> None:
    """Torch reference of :func:`merge_splits` (in place into ``out``). part_acc [S, T, Hq, D] fp32;
    part_ml [S, T, Hq, 2] fp32 (max, sum); positions [T] int64; out [T, Hq, D]; ``wave_splits``, ``max_chunk``:
    the split geometry (:func:`split_geometry_ref`). ``pdl``: a launch detail of the kernel, unused here."""
    num_splits, num_tokens = part_acc.shape[:2]
    _, _, num_used = split_geometry_ref(positions, query_len, window, num_splits, min_chunk, block_n, wave_splits,
                                        max_chunk)
    used_per_token = num_used.repeat_interleave(query_len)[:num_tokens]  # [T]
    split_used = torch.arange(num_splits, device=out.device)[:, None] < used_per_token[None]  # [S, T]
    m = part_ml[..., 0].masked_fill(~split_used[..., None], float("-inf"))  # [S, T, Hq]
    m_max = m.max(0).values
    weight = torch.exp(m - torch.where(m_max == float("-inf"), 0.0, m_max)).nan_to_num(0.0)  # [S, T, Hq]
    acc = (weight[..., None] * part_acc.nan_to_num(0.0)).sum(0)
    total = (weight * part_ml[..., 1].nan_to_num(0.0)).sum(0)
    merged = (acc / torch.where(total == 0.0, 1.0, total)[..., None]).to(out.dtype)
    merge_tokens = used_per_token > 1
    out[merge_tokens] = merged[merge_tokens]


def merge_splits(part_acc: torch.Tensor, part_ml: torch.Tensor, positions: torch.Tensor, out: torch.Tensor,
                 query_len: int, window: int, block_n: int, min_chunk: int, pdl: bool = False,
                 wave_splits: int | None = None, max_chunk: int = NO_MAX_CHUNK) -> None:
    """Combine the used splits of every run whose keys took more than one chunk into ``out`` (shapes as in
    :func:`merge_splits_ref`). One program per (token, query head): its splits' partials in one tile."""
    num_splits, num_tokens, num_q_heads, head_dim = part_acc.shape
    assert part_acc.is_contiguous() and part_ml.is_contiguous() and out.is_contiguous()
    _merge_splits_kernel[(num_tokens, num_q_heads)](
        part_acc, part_ml, positions, out, num_tokens, window, num_splits, wave_splits or num_splits,
        NUM_Q_HEADS=num_q_heads,
        QUERY_LEN=query_len, QUERY_LEN_PAD=triton.next_power_of_2(query_len), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_N=block_n, SPLITS_PAD=SPLITS_PAD,
        MIN_CHUNK=min_chunk, MAX_CHUNK=min(max_chunk, NO_MAX_CHUNK), PDL=pdl, num_warps=4,
        **dependent_launch.launch_options(pdl))


if triton is not None:
    from .dependent_launch import wait_and_release

    @triton.jit
    def split_chunk(num_keys, num_splits, wave_splits, MIN_CHUNK: tl.constexpr, MAX_CHUNK: tl.constexpr,
                    BLOCK_N: tl.constexpr):
        """Keys per split: num_keys over wave_splits (more where a chunk would pass MAX_CHUNK; num_splits at
        most), at least MIN_CHUNK, rounded up to whole blocks."""
        splits = tl.minimum(tl.maximum((num_keys + MAX_CHUNK - 1) // MAX_CHUNK, wave_splits), num_splits)
        per_split = tl.maximum((num_keys + splits - 1) // splits, MIN_CHUNK)
        return (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N

    @triton.jit
    def split_bounds(pos, row_ok, window, num_splits, wave_splits, MIN_CHUNK: tl.constexpr, MAX_CHUNK: tl.constexpr,
                     BLOCK_N: tl.constexpr):
        """(lo, last, chunk, num_used) of a run from its rows' positions pos [ROWS_PAD] (-1 where not row_ok):
        one split for fewer than two minimum chunks of keys; the last used split runs on to ``last``
        (:func:`split_stop`)."""
        last = tl.max(pos, 0)
        lo = last * 0
        if window > 0:
            lowest = tl.min(tl.where(row_ok, pos, last), 0)
            lo = (tl.maximum(lowest - window + 1, 0) // BLOCK_N) * BLOCK_N
        chunk = split_chunk(last + 1 - lo, num_splits, wave_splits, MIN_CHUNK, MAX_CHUNK, BLOCK_N)
        keys = last + 1 - lo
        return lo, last, chunk, tl.where(keys < 2 * MIN_CHUNK, 1, (keys + chunk - 1) // chunk)

    @triton.jit
    def split_stop(start, chunk, last, split, num_used):
        """The end (exclusive) of used split ``split``'s keys from ``start``: a chunk on, ``last + 1`` for the last
        (a run's only split takes all its keys)."""
        return tl.where(split == num_used - 1, last + 1, tl.minimum(start + chunk, last + 1))

    @triton.jit(do_not_specialize=["num_tokens", "num_splits", "wave_splits"])
    def _merge_splits_kernel(part_acc_ptr, part_ml_ptr, positions_ptr, out_ptr, num_tokens, window, num_splits,
                             wave_splits, NUM_Q_HEADS: tl.constexpr, QUERY_LEN: tl.constexpr,
                             QUERY_LEN_PAD: tl.constexpr,
                             HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                             SPLITS_PAD: tl.constexpr, MIN_CHUNK: tl.constexpr, MAX_CHUNK: tl.constexpr,
                             PDL: tl.constexpr):
        if PDL:
            wait_and_release()
        token = tl.program_id(0)
        head = tl.program_id(1)
        run = (token // QUERY_LEN) * QUERY_LEN + tl.arange(0, QUERY_LEN_PAD)  # the tokens of this token's run
        run_ok = (tl.arange(0, QUERY_LEN_PAD) < QUERY_LEN) & (run < num_tokens)
        pos = tl.load(positions_ptr + run, mask=run_ok, other=-1).to(tl.int64)
        lo, last, chunk, num_used = split_bounds(pos, run_ok, window, num_splits, wave_splits, MIN_CHUNK, MAX_CHUNK,
                                                 BLOCK_N)
        if num_used > 1:
            splits = tl.arange(0, SPLITS_PAD)
            split_ok = splits < num_used
            dims = tl.arange(0, HEAD_DIM_PAD)
            rows = (splits.to(tl.int64) * num_tokens + token) * NUM_Q_HEADS + head  # [SPLITS_PAD]
            m = tl.load(part_ml_ptr + rows * 2, mask=split_ok, other=float("-inf"))
            total = tl.load(part_ml_ptr + rows * 2 + 1, mask=split_ok, other=0.0)
            m_max = tl.max(m, 0)
            weight = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # 0 for unused splits
            tile_ok = split_ok[:, None] & (dims < HEAD_DIM)[None, :]
            acc = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=tile_ok, other=0.0)
            norm = tl.sum(weight * total, 0)
            out = tl.sum(acc * weight[:, None], 0) / tl.where(norm == 0.0, 1.0, norm)
            dst = (token.to(tl.int64) * NUM_Q_HEADS + head) * HEAD_DIM + dims
            tl.store(out_ptr + dst, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
