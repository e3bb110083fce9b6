"""Paged causal attention: each query token attends to its request's cached positions <= its own.

One op covers K+1-token verification and 1-token draft steps (and, in the reference, ragged prefill), because its
only per-token inputs are device tensors: the request slot and the position of every query token. Lengths never
reach the host, so the op can sit inside a CUDA graph.

Split-KV (flash-decoding): where a batch has too few (request run, KV head) programs to fill the GPU, each run's
keys are split over ``num_splits`` programs. The split grid is a host value fixed when a step is built (or a CUDA
graph captured: from the SM count, the runs, the KV heads and the bound on the context); each run's split count and
chunk are computed on the device from its own length (as many splits as fill one wave, more for chunks past
MAX_KEYS_PER_SPLIT keys, :mod:`.attention_merge`), so one launch (or graph) serves every context length as a launch
sized for that length would. The split count is a runtime argument of both kernels (never a compile-time constant),
so the steps run without a CUDA graph (prefill, mixed steps), whose bound on the context changes from step to step,
compile nothing new on a request's path. Each split leaves its partial (acc, max, sum) in an fp32 workspace and
:mod:`.attention_merge` combines them by log-sum-exp; a run whose keys fit one chunk is finished by its first split
and skipped by the merge.
"""
from __future__ import annotations

import torch

from .. import kernels
from . import dependent_launch
from .attention_merge import MAX_SPLITS, NO_MAX_CHUNK, merge_splits
from .attention_plan import (MAX_KEYS_PER_SPLIT, MIN_KEYS_PER_SPLIT, attention_tile, choose_num_splits,
                             choose_program_rows, num_sms, wave_splits)
from .kv_write import kv_write_ref

TREE_WINDOW = 63  # a tree token's mask covers the 63 positions up to its own (the int64's non-sign bits)
NUM_STAGES = 3  # key blocks in flight per program (software pipelining of the key loop)
PREFETCH_BLOCKS = 2  # key blocks whose cached K/V a dependent launch asks L2 for before its wait
_ELEMENTS_PER_CHUNK = 1 << 24  # bounds the gathered K/V of the reference to ~64 MB in fp32

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor,
                        scale: float, max_kv_len: int, sliding_window: int | None = None, query_len: int = 1,
                        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                        num_splits: int | None = None, tree_mask: torch.Tensor | None = None,
                        k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Torch reference (the CPU path and the oracle).

    q [T, Hq, D] (dense heads; its tokens may have a stride); k_cache, v_cache [num_pages, page_size, Hkv, D];
    block_tables [S, P] int32; token_slots [T] int64 (block-table row of each token); positions [T] int64;
    max_kv_len: a host bound on positions + 1 (only limits work); sliding_window: keys older than this many
    positions are masked;
    query_len: runs of this many consecutive tokens share a slot (their pages are gathered once);
    new_kv: this forward's (k, v) [T, Hkv, D], written into the cache first;
    num_splits: how the kernel divides the keys (no effect on the result; ignored here);
    tree_mask: [T] int64 or None, a draft tree's visibility (:func:`tree_visible`): bit j of token t's entry
    lets it see the key j positions below its own; keys TREE_WINDOW or more below are always visible;
    k_scale, v_scale: an FP8 cache's scales (:mod:`.kv_write`): scores times scale * k_scale, output times v_scale.
    Returns [T, Hq, D] in q's dtype, softmax in fp32.
    """
    if new_kv is not None:
        kv_write_ref(*new_kv, k_cache, v_cache, block_tables, token_slots, positions, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    run = query_len if num_tokens % query_len == 0 else 1
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_pages = min(block_tables.shape[1], -(-max_kv_len // page_size))
    num_keys = num_pages * page_size
    group = num_q_heads // num_kv_heads
    chunk = run * max(1, _ELEMENTS_PER_CHUNK // (num_keys * num_kv_heads * head_dim))
    key_pos = torch.arange(num_keys, device=q.device)
    out = torch.empty_like(q)
    for start in range(0, num_tokens, chunk):
        rows = slice(start, start + chunk)
        pages = block_tables[token_slots[rows][::run], :num_pages].long()  # [runs, num_pages]
        k = k_cache[pages].flatten(1, 2).float()  # [runs, num_keys, Hkv, D]
        v = v_cache[pages].flatten(1, 2).float()
        qg = q[rows].float().reshape(-1, run, num_kv_heads, group, head_dim)
        scores = torch.einsum("rthgd,rshd->rthgs", qg, k) * (scale * k_scale)
        pos = positions[rows].view(-1, run, 1)
        visible = key_pos <= pos  # [runs, run, num_keys]
        if tree_mask is not None:
            visible &= tree_visible(pos - key_pos, tree_mask[rows].view(-1, run, 1))
        if sliding_window is not None:
            visible &= key_pos > pos - sliding_window
        probs = scores.masked_fill(~visible[:, :, None, None, :], float("-inf")).softmax(-1)
        o = torch.einsum("rthgs,rshd->rthgd", probs, v) * v_scale
        out[rows] = o.reshape(-1, num_q_heads, head_dim).to(q.dtype)
    return out


def tree_visible(offsets: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
    """Which keys a tree token sees among those not above it: offsets (its position minus the key's, >= 0 where
    it matters) below TREE_WINDOW by the bits of its tree_mask (bit j: offset j), the rest always. Broadcasts."""
    in_window = (offsets >= 0) & (offsets < TREE_WINDOW)
    bits = (tree_mask >> offsets.clamp(0, TREE_WINDOW - 1)) & 1
    return ~in_window | (bits == 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    token_slots: torch.Tensor, positions: torch.Tensor, scale: float, max_kv_len: int,
                    sliding_window: int | None = None, query_len: int = 1,
                    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                    num_splits: int | None = None, tree_mask: torch.Tensor | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    tile: tuple[int, int] | None = None, program_rows: int | None = None) -> torch.Tensor:
    """The Triton kernel on CUDA (reads positions and block tables on the device), else the reference.

    ``query_len``: consecutive query tokens that belong to one request (K+1 in a verify step, 1 in a draft
    step): one program serves all of them, so a request's K/V is read once, not once per query token. The
    caller guarantees that every run of ``query_len`` tokens shares one slot; 1 is always correct.
    ``new_kv``: this forward's (k, v) [N, Hkv, D], written into the cache by the same program before it
    attends (one launch instead of two). Only valid when each run holds ALL of its request's new tokens.
    ``num_splits``: KV splits per run, each long enough run using all of them (None: a grid of
    :func:`choose_num_splits` for the bound, of which each run uses what :func:`wave_splits` and its own length
    give; 1: the unsplit kernel).
    ``tree_mask``: a draft tree's visibility (:func:`paged_attention_ref`), [T] int64, read per query row.
    ``k_scale``, ``v_scale``: as the reference's; the kernel widens an FP8 cache's keys and values to fp16 (bf16 q too).
    ``tile``: (keys per iteration, warps) of a program (None: :func:`attention_tile`; for benchmarks).
    ``program_rows``: query rows per program at most (None: :func:`choose_program_rows` for a draft tree's run,
    one program for any other run; for benchmarks). A run of more rows (query_len x the query heads of a KV head)
    is served by several programs, one per block of rows, each reading the run's keys (from L2 after the
    first): more programs in flight, smaller tiles. Measured for trees only, so chains keep one program a run.
    """
    if not kernels.runs_kernel(q):
        return paged_attention_ref(q, k_cache, v_cache, block_tables, token_slots, positions, scale, max_kv_len,
                                   sliding_window, query_len, new_kv, num_splits, tree_mask, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim, "q's heads must be dense (its tokens may have a stride)"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "contiguous caches expected"
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim and num_q_heads % num_kv_heads == 0
    assert block_tables.dtype == torch.int32 and block_tables.is_contiguous() and query_len >= 1
    group = num_q_heads // num_kv_heads
    out = q.new_empty(q.shape)
    if num_tokens == 0:
        return out
    k_new, v_new = new_kv if new_kv is not None else (k_cache, v_cache)  # unused pointers without WRITE
    assert new_kv is None or (k_new.shape == v_new.shape == (num_tokens, num_kv_heads, head_dim)
                              and k_new.stride(2) == v_new.stride(2) == 1)
    num_runs = triton.cdiv(num_tokens, query_len)
    run_rows = group * query_len
    if program_rows is None and tree_mask is not None:  # a draft tree's many rows: blocks of them
        program_rows = choose_program_rows(run_rows, num_runs * num_kv_heads, num_sms(q.device))
    rows_pad = max(16, triton.next_power_of_2(run_rows))  # one program a run, but for row blocks
    rows_pad = min(rows_pad, program_rows) if program_rows else rows_pad
    row_blocks = triton.cdiv(run_rows, rows_pad)
    if num_splits is None:  # the grid for the bound; each run's own length picks how many of them it uses
        num_programs, sms = num_runs * row_blocks * num_kv_heads, num_sms(q.device)
        num_splits = choose_num_splits(num_programs, max_kv_len, sms)
        wave, max_chunk = wave_splits(num_programs, sms), MAX_KEYS_PER_SPLIT
    else:  # asked for: every run long enough uses all of them
        wave, max_chunk = num_splits, NO_MAX_CHUNK
    assert 1 <= num_splits <= MAX_SPLITS
    # partial (acc, max, sum) per split; never read where a run's keys fit one chunk
    part_acc = q.new_empty((num_splits, num_tokens, num_q_heads, head_dim), dtype=torch.float32)
    part_ml = q.new_empty((num_splits, num_tokens, num_q_heads, 2), dtype=torch.float32)
    assert tree_mask is None or (tree_mask.shape == (num_tokens,) and tree_mask.dtype == torch.int64)
    pdl = dependent_launch.launches_dependent(q)
    block_n, num_warps = tile or attention_tile(rows_pad)
    _paged_attention_kernel[(num_runs * row_blocks, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, token_slots, positions, positions if tree_mask is None else tree_mask,
        tree_mask is not None, out, part_acc, part_ml, scale * k_scale, num_tokens,
        q.stride(0), k_new, v_new, 1.0 / k_scale, 1.0 / v_scale, *k_new.stride()[:2], *v_new.stride()[:2],
        new_kv is not None, block_tables.stride(0), block_tables.shape[0], sliding_window or 0, num_splits, wave,
        PAGE_SIZE=page_size, NUM_KV_HEADS=num_kv_heads, GROUP=group, QUERY_LEN=query_len,
        QUERY_LEN_PAD=triton.next_power_of_2(query_len), ROWS_PAD=rows_pad, ROW_BLOCKS=row_blocks, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_N=block_n, MIN_CHUNK=MIN_KEYS_PER_SPLIT, PDL=pdl,
        MAX_CHUNK=max_chunk, NUM_STAGES=NUM_STAGES, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        F16_DOTS=k_cache.element_size() == 1 and q.dtype == torch.bfloat16,
        PREFETCH_BLOCKS=PREFETCH_BLOCKS if pdl else 0, KV_LINE=128 // k_cache.element_size(), num_warps=num_warps,
        **dependent_launch.launch_options(pdl))
    if num_splits > 1:
        merge_splits(part_acc, part_ml, positions, out, query_len, sliding_window or 0, block_n,
                     MIN_KEYS_PER_SPLIT, pdl, wave, max_chunk)
    return out if v_scale == 1.0 else out.mul_(v_scale)


if triton is not None:
    from .attention_merge import split_bounds, split_chunk, split_stop
    from .dependent_launch import prefetch_l2, wait_and_release
    from .kv_write import to_cache

    TREE_WINDOW_C = tl.constexpr(TREE_WINDOW)  # the kernel reads globals only as constexprs

    @triton.jit(do_not_specialize=["num_tokens", "num_splits", "wave_splits"])
    def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, block_tables_ptr, token_slots_ptr, positions_ptr,
                                tree_mask_ptr, TREE: tl.constexpr, out_ptr,
                                part_acc_ptr, part_ml_ptr, scale, num_tokens, q_stride_t, k_new_ptr, v_new_ptr,
                                inv_k_scale, inv_v_scale, kn_stride_t, kn_stride_h, vn_stride_t, vn_stride_h,
                                WRITE: tl.constexpr, bt_stride, bt_rows, window, num_splits, wave_splits,
                                PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                                GROUP: tl.constexpr, QUERY_LEN: tl.constexpr, QUERY_LEN_PAD: tl.constexpr,
                                ROWS_PAD: tl.constexpr, ROW_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr,
                                HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                                MIN_CHUNK: tl.constexpr, MAX_CHUNK: tl.constexpr, NUM_STAGES: tl.constexpr,
                                DOT_PRECISION: tl.constexpr, F16_DOTS: tl.constexpr,
                                PDL: tl.constexpr, PREFETCH_BLOCKS: tl.constexpr, KV_LINE: tl.constexpr):
        """One program per (run of QUERY_LEN query tokens of one request and block of its rows, KV head, KV
        split). A run's rows are the QUERY_LEN x GROUP query heads sharing that KV head (row r: token r // GROUP,
        head r % GROUP), cut into ROW_BLOCKS blocks of ROWS_PAD (one block but for a draft tree's run), each
        row with its own causal bound; online softmax over the key blocks of its split (:func:`split_bounds`: the
        run's keys up to its last position, in equal chunks of whole blocks; fewer than two minimum chunks of
        keys in one split). With WRITE it first stores the run's new K/V rows of its KV head whose positions fall in its
        split (no program of another split reads them in this launch; the run's other row blocks store the same
        values before they read them). A run whose keys fit one chunk is finished here; otherwise each used split
        leaves its partial (acc, max, sum) for :func:`merge_splits`. PDL (:mod:`.dependent_launch`): while the
        kernel before runs, the program asks L2 for the cached K/V of its split's first PREFETCH_BLOCKS key
        blocks (addresses from the step's positions and block table, which that kernel does not write; a
        prefetch only warms L2, so it cannot change a result). TREE: each row also obeys its token's draft-tree
        mask (:func:`tree_visible`: bit j lets it see the key j positions below its own, for j < TREE_WINDOW)."""
        first = tl.program_id(0) // ROW_BLOCKS * QUERY_LEN
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        if PDL and PREFETCH_BLOCKS > 0:  # first: the K/V reads in flight while the kernel in front ends
            _prefetch_kv(k_ptr, v_ptr, block_tables_ptr, token_slots_ptr, positions_ptr, first, num_tokens,
                         kv_head, split, bt_stride, bt_rows, PAGE_SIZE, NUM_KV_HEADS, QUERY_LEN, HEAD_DIM,
                         HEAD_DIM_PAD, BLOCK_N, num_splits, wave_splits, MIN_CHUNK, MAX_CHUNK, PREFETCH_BLOCKS,
                         KV_LINE)
        # the run's split geometry from its positions, read before the wait (no kernel writes a step's positions
        # right before its attention: a chain's feed the rotary embedding of the projection in front of it, a draft
        # tree's attention follows its KV-write kernel; dependent_launch)
        rows = tl.program_id(0) % ROW_BLOCKS * ROWS_PAD + tl.arange(0, ROWS_PAD)
        token = first + rows // GROUP
        row_ok = (rows < QUERY_LEN * GROUP) & (token < num_tokens)
        pos = tl.load(positions_ptr + token, mask=row_ok, other=-1).to(tl.int64)  # [ROWS_PAD]
        if ROW_BLOCKS == 1:  # the rows hold every token of the run
            lo, last, chunk, num_used = split_bounds(pos, row_ok, window, num_splits, wave_splits, MIN_CHUNK,
                                                     MAX_CHUNK, BLOCK_N)
        else:  # the split geometry is the whole run's (every row block and the merge agree on it)
            run_token = first + tl.arange(0, QUERY_LEN_PAD)
            run_ok = (tl.arange(0, QUERY_LEN_PAD) < QUERY_LEN) & (run_token < num_tokens)
            run_pos = tl.load(positions_ptr + run_token, mask=run_ok, other=-1).to(tl.int64)
            lo, last, chunk, num_used = split_bounds(run_pos, run_ok, window, num_splits, wave_splits, MIN_CHUNK,
                                                     MAX_CHUNK, BLOCK_N)
        if split >= num_used:  # a split this run does not use: gone at once, without waiting for the kernel before
            return
        if PDL:
            wait_and_release()
        if TREE:
            tree_bits = tl.load(tree_mask_ptr + token, mask=row_ok, other=-1)  # [ROWS_PAD] int64
        start = lo + split * chunk
        stop = split_stop(start, chunk, last, split, num_used)  # this split's keys: [start, stop)
        if WRITE:
            _write_run(k_new_ptr, v_new_ptr, k_ptr, v_ptr, block_tables_ptr, token_slots_ptr, positions_ptr, first,
                       num_tokens, kv_head, start, stop, kn_stride_t, kn_stride_h, vn_stride_t, vn_stride_h,
                       bt_stride, inv_k_scale, inv_v_scale, PAGE_SIZE, NUM_KV_HEADS, QUERY_LEN, HEAD_DIM, HEAD_DIM_PAD)
            tl.debug_barrier()  # the run's stores are visible to the whole program before it reads them
        slot = tl.load(token_slots_ptr + first).to(tl.int64)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
        heads = (kv_head * GROUP + rows % GROUP) * HEAD_DIM
        q = tl.load(q_ptr + (token.to(tl.int64) * q_stride_t + heads)[:, None] + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if F16_DOTS:  # FP8 pages widen to fp16 in one instruction a pair (to bf16 in several); q scaled first
            q = (q.to(tl.float32) * scale).to(tl.float16)
        m_i = tl.full([ROWS_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS_PAD], tl.float32)
        acc = tl.zeros([ROWS_PAD, HEAD_DIM_PAD], tl.float32)
        for block_start in tl.range(start, stop, BLOCK_N, num_stages=NUM_STAGES):  # bounds loaded on the device
            kpos = block_start + tl.arange(0, BLOCK_N)
            in_run = kpos < stop
            visible = kpos[None, :] <= pos[:, None]
            if window > 0:
                visible = visible & (kpos[None, :] > pos[:, None] - window)
            if TREE:
                below = pos[:, None] - kpos[None, :]  # >= 0 where visible
                in_tree = (below >= 0) & (below < TREE_WINDOW_C)
                bit = (tree_bits[:, None] >> tl.minimum(tl.maximum(below, 0), TREE_WINDOW_C - 1)) & 1
                visible = visible & (~in_tree | (bit == 1))
            page = tl.load(block_tables_ptr + slot * bt_stride + kpos // PAGE_SIZE, mask=in_run, other=0)
            kv_rows = ((page.to(tl.int64) * PAGE_SIZE + kpos % PAGE_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM
            kv_mask = in_run[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + kv_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_ptr + kv_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # FP8 cache
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32)
            if not F16_DOTS:
                s = s * scale
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
            m_i = m_new
        head_rows = token.to(tl.int64) * NUM_KV_HEADS * GROUP + kv_head * GROUP + rows % GROUP  # [ROWS_PAD]
        tile = head_rows[:, None] * HEAD_DIM + dims[None, :]
        tile_ok = row_ok[:, None] & dim_ok[None, :]
        if num_used == 1:  # the whole run in one chunk (split 0, the only program left): finish here
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + tile, out.to(out_ptr.dtype.element_ty), mask=tile_ok)
        else:  # a used split (the others exited above): its partial for the merge
            part = split.to(tl.int64) * num_tokens * NUM_KV_HEADS * GROUP
            tl.store(part_acc_ptr + part * HEAD_DIM + tile, acc, mask=tile_ok)
            tl.store(part_ml_ptr + (part + head_rows) * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + (part + head_rows) * 2 + 1, l_i, mask=row_ok)

    @triton.jit
    def _prefetch_kv(k_ptr, v_ptr, block_tables_ptr, token_slots_ptr, positions_ptr, first, num_tokens, kv_head,
                     split, bt_stride, bt_rows, PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                     QUERY_LEN: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                     BLOCK_N: tl.constexpr, num_splits, wave_splits, MIN_CHUNK: tl.constexpr,
                     MAX_CHUNK: tl.constexpr, PREFETCH_BLOCKS: tl.constexpr, KV_LINE: tl.constexpr):
        """Ask L2 for the K/V rows of head kv_head at the first PREFETCH_BLOCKS * BLOCK_N positions of the
        program's split (its chunk as without a sliding window; only a hint), up to the run's last token's. It
        runs before the wait: the slot is clamped and the block-table columns masked, so even a value the kernel
        before were still writing could only send a prefetch elsewhere in the cache."""
        last = tl.load(positions_ptr + tl.minimum(first + QUERY_LEN - 1, num_tokens - 1))  # a run's positions rise
        slot = tl.minimum(tl.maximum(tl.load(token_slots_ptr + first).to(tl.int64), 0), bt_rows - 1)
        lines = tl.arange(0, (HEAD_DIM_PAD + KV_LINE - 1) // KV_LINE) * KV_LINE
        chunk = split_chunk(last + 1, num_splits, wave_splits, MIN_CHUNK, MAX_CHUNK, BLOCK_N)
        start = split * chunk
        for block in tl.static_range(PREFETCH_BLOCKS):
            kpos = start + block * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = (kpos <= last) & (kpos < start + chunk) & (kpos // PAGE_SIZE < bt_stride)
            page = tl.load(block_tables_ptr + slot * bt_stride + kpos // PAGE_SIZE, mask=ok, other=0)
            rows = ((page.to(tl.int64) * PAGE_SIZE + kpos % PAGE_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM
            prefetch_l2(k_ptr + rows[:, None] + lines[None, :], ok[:, None])
            prefetch_l2(v_ptr + rows[:, None] + lines[None, :], ok[:, None])

    @triton.jit
    def _write_run(k_new_ptr, v_new_ptr, k_ptr, v_ptr, block_tables_ptr, token_slots_ptr, positions_ptr, first,
                   num_tokens, kv_head, lo, hi, kn_stride_t, kn_stride_h, vn_stride_t, vn_stride_h, bt_stride,
                   inv_k_scale, inv_v_scale, PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   QUERY_LEN: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
        """Store K/V of tokens first..first+QUERY_LEN-1 whose positions lie in [lo, hi), head kv_head, at their
        (slot, position) pages."""
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
        for i in tl.static_range(QUERY_LEN):
            token = first + i
            if token < num_tokens:
                slot = tl.load(token_slots_ptr + token).to(tl.int64)
                pos = tl.load(positions_ptr + token).to(tl.int64)
                mine = tl.where((pos >= lo) & (pos < hi), dim_ok, False)  # (scalar & tensor: a where)
                page = tl.load(block_tables_ptr + slot * bt_stride + pos // PAGE_SIZE).to(tl.int64)
                dst = ((page * PAGE_SIZE + pos % PAGE_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims
                k = tl.load(k_new_ptr + token * kn_stride_t + kv_head * kn_stride_h + dims, mask=mine)
                v = tl.load(v_new_ptr + token * vn_stride_t + kv_head * vn_stride_h + dims, mask=mine)
                tl.store(k_ptr + dst, to_cache(k, k_ptr, inv_k_scale), mask=mine)
                tl.store(v_ptr + dst, to_cache(v, v_ptr, inv_v_scale), mask=mine)
