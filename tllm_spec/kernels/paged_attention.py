"""Paged causal attention: each query token attends to its request's cached positions <= its own.

One op covers K+1-token verification and 1-token draft steps (and, in the reference, ragged prefill),
because its only per-token inputs are device tensors: the request slot and the position of every query
token. Lengths never reach the host, so the op can sit inside a CUDA graph.
"""
from __future__ import annotations

import torch

from .. import kernels
from . import dependent_launch
from .kv_write import kv_write_ref

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
                        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Torch reference (the CPU path and the oracle).

    q [T, Hq, D] (dense heads; its tokens may have a stride); k_cache, v_cache [num_pages, page_size, Hkv, D];
    block_tables [S, P] int32; token_slots [T] int64 (block-table row of each token); positions [T] int64;
    max_kv_len: a host bound on positions + 1 (only limits work); sliding_window: keys older than this many
    positions are masked;
    query_len: runs of this many consecutive tokens share a slot (their pages are gathered once);
    new_kv: this forward's (k, v) [T, Hkv, D], written into the cache first.
    Returns [T, Hq, D] in q's dtype, softmax in fp32.
    """
    if new_kv is not None:
        kv_write_ref(*new_kv, k_cache, v_cache, block_tables, token_slots, positions)
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
        scores = torch.einsum("rthgd,rshd->rthgs", qg, k) * scale
        pos = positions[rows].view(-1, run, 1)
        visible = key_pos <= pos  # [runs, run, num_keys]
        if sliding_window is not None:
            visible &= key_pos > pos - sliding_window
        probs = scores.masked_fill(~visible[:, :, None, None, :], float("-inf")).softmax(-1)
        o = torch.einsum("rthgs,rshd->rthgd", probs, v)
        out[rows] = o.reshape(-1, num_q_heads, head_dim).to(q.dtype)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    token_slots: torch.Tensor, positions: torch.Tensor, scale: float, max_kv_len: int,
                    sliding_window: int | None = None, query_len: int = 1,
                    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The Triton kernel on CUDA (reads positions and block tables on the device), else the reference.

    ``query_len``: consecutive query tokens that belong to one request (K+1 in a verify step, 1 in a draft
    step): one program serves all of them, so a request's K/V is read once, not once per query token. The
    caller guarantees that every run of ``query_len`` tokens shares one slot; 1 is always correct.
    ``new_kv``: this forward's (k, v) [N, Hkv, D], written into the cache by the same program before it
    attends (one launch instead of two). Only valid when each run holds ALL of its request's new tokens.
    """
    if not kernels.runs_kernel(q):
        return paged_attention_ref(q, k_cache, v_cache, block_tables, token_slots, positions, scale, max_kv_len,
                                   sliding_window, query_len, new_kv)
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
    pdl = dependent_launch.launches_dependent(q)
    _paged_attention_kernel[(triton.cdiv(num_tokens, query_len), num_kv_heads)](
        q, k_cache, v_cache, block_tables, token_slots, positions, out, scale, num_tokens, q.stride(0),
        k_new, v_new, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), new_kv is not None,
        block_tables.stride(0), block_tables.shape[0], sliding_window or 0,
        PAGE_SIZE=page_size, NUM_KV_HEADS=num_kv_heads, GROUP=group, QUERY_LEN=query_len,
        ROWS_PAD=max(16, triton.next_power_of_2(group * query_len)), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_N=128,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl,
        PREFETCH_BLOCKS=PREFETCH_BLOCKS if pdl else 0, KV_LINE=128 // k_cache.element_size(), num_warps=4,
        **dependent_launch.launch_options(pdl))
    return out


if triton is not None:
    from .dependent_launch import prefetch_l2, wait_and_release

    @triton.jit
    def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, block_tables_ptr, token_slots_ptr, positions_ptr, out_ptr,
                                scale, num_tokens, q_stride_t, k_new_ptr, v_new_ptr, kn_stride_t, kn_stride_h,
                                vn_stride_t, vn_stride_h, WRITE: tl.constexpr, bt_stride, bt_rows, window,
                                PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                                QUERY_LEN: tl.constexpr, ROWS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                                HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                PDL: tl.constexpr, PREFETCH_BLOCKS: tl.constexpr, KV_LINE: tl.constexpr):
        """One program per (run of QUERY_LEN query tokens of one request, KV head). With WRITE it first
        stores the run's new K/V rows of its KV head (nobody else reads them in this launch). Its rows are the
        QUERY_LEN x GROUP query heads sharing that KV head (row r: token r // GROUP, head r % GROUP), each
        with its own causal bound; online softmax over key blocks up to the run's last position. PDL
        (:mod:`.dependent_launch`): while the kernel before runs, the program asks L2 for the cached K/V of its
        first PREFETCH_BLOCKS key blocks (addresses from the step's positions and block table, which that
        kernel does not write; a prefetch only warms L2, so it cannot change a result)."""
        first = tl.program_id(0) * QUERY_LEN
        kv_head = tl.program_id(1)
        if PDL:
            if PREFETCH_BLOCKS > 0:
                _prefetch_kv(k_ptr, v_ptr, block_tables_ptr, token_slots_ptr, positions_ptr, first, num_tokens,
                             kv_head, bt_stride, bt_rows, PAGE_SIZE, NUM_KV_HEADS, QUERY_LEN, HEAD_DIM,
                             HEAD_DIM_PAD, BLOCK_N, PREFETCH_BLOCKS, KV_LINE)
            wait_and_release()
        if WRITE:
            _write_run(k_new_ptr, v_new_ptr, k_ptr, v_ptr, block_tables_ptr, token_slots_ptr, positions_ptr, first,
                       num_tokens, kv_head, kn_stride_t, kn_stride_h, vn_stride_t, vn_stride_h, bt_stride,
                       PAGE_SIZE, NUM_KV_HEADS, QUERY_LEN, HEAD_DIM, HEAD_DIM_PAD)
            tl.debug_barrier()  # the run's stores are visible to the whole program before it reads them
        rows = tl.arange(0, ROWS_PAD)
        token = first + rows // GROUP
        row_ok = (rows < QUERY_LEN * GROUP) & (token < num_tokens)
        pos = tl.load(positions_ptr + token, mask=row_ok, other=-1).to(tl.int64)  # [ROWS_PAD]
        slot = tl.load(token_slots_ptr + first).to(tl.int64)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
        heads = (kv_head * GROUP + rows % GROUP) * HEAD_DIM
        q = tl.load(q_ptr + (token.to(tl.int64) * q_stride_t + heads)[:, None] + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        m_i = tl.full([ROWS_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS_PAD], tl.float32)
        acc = tl.zeros([ROWS_PAD, HEAD_DIM_PAD], tl.float32)
        last = tl.max(pos, 0)
        start = last * 0
        if window > 0:
            lowest = tl.min(tl.where(row_ok, pos, last), 0)
            start = (tl.maximum(lowest - window + 1, 0) // BLOCK_N) * BLOCK_N
        while start <= last:  # a while loop: the bound is a loaded value
            kpos = start + tl.arange(0, BLOCK_N)
            in_run = kpos <= last
            visible = kpos[None, :] <= pos[:, None]
            if window > 0:
                visible = visible & (kpos[None, :] > pos[:, None] - window)
            page = tl.load(block_tables_ptr + slot * bt_stride + kpos // PAGE_SIZE, mask=in_run, other=0)
            kv_rows = ((page.to(tl.int64) * PAGE_SIZE + kpos % PAGE_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM
            kv_mask = in_run[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + kv_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
            m_i = m_new
            start += BLOCK_N
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_rows = token.to(tl.int64) * NUM_KV_HEADS * GROUP * HEAD_DIM + heads
        tl.store(out_ptr + out_rows[:, None] + dims[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])

    @triton.jit
    def _prefetch_kv(k_ptr, v_ptr, block_tables_ptr, token_slots_ptr, positions_ptr, first, num_tokens, kv_head,
                     bt_stride, bt_rows, PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, QUERY_LEN: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                     PREFETCH_BLOCKS: tl.constexpr, KV_LINE: tl.constexpr):
        """Ask L2 for the K/V rows of head kv_head at the run's first PREFETCH_BLOCKS * BLOCK_N positions up to
        its last token's. It runs before the wait: the slot is clamped and the block-table columns masked, so even
        a value the kernel before were still writing could only send a prefetch elsewhere in the cache."""
        last = tl.load(positions_ptr + tl.minimum(first + QUERY_LEN - 1, num_tokens - 1))  # a run's positions rise
        slot = tl.minimum(tl.maximum(tl.load(token_slots_ptr + first).to(tl.int64), 0), bt_rows - 1)
        lines = tl.arange(0, (HEAD_DIM_PAD + KV_LINE - 1) // KV_LINE) * KV_LINE
        for block in tl.static_range(PREFETCH_BLOCKS):
            kpos = block * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = (kpos <= last) & (kpos // PAGE_SIZE < bt_stride)
            page = tl.load(block_tables_ptr + slot * bt_stride + kpos // PAGE_SIZE, mask=ok, other=0)
            rows = ((page.to(tl.int64) * PAGE_SIZE + kpos % PAGE_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM
            prefetch_l2(k_ptr + rows[:, None] + lines[None, :], ok[:, None])
            prefetch_l2(v_ptr + rows[:, None] + lines[None, :], ok[:, None])

    @triton.jit
    def _write_run(k_new_ptr, v_new_ptr, k_ptr, v_ptr, block_tables_ptr, token_slots_ptr, positions_ptr, first,
                   num_tokens, kv_head, kn_stride_t, kn_stride_h, vn_stride_t, vn_stride_h, bt_stride,
                   PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, QUERY_LEN: tl.constexpr,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
        """Store K/V of tokens first..first+QUERY_LEN-1, head kv_head, at their (slot, position) pages."""
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
        for i in tl.static_range(QUERY_LEN):
            token = first + i
            if token < num_tokens:
                slot = tl.load(token_slots_ptr + token).to(tl.int64)
                pos = tl.load(positions_ptr + token).to(tl.int64)
                page = tl.load(block_tables_ptr + slot * bt_stride + pos // PAGE_SIZE).to(tl.int64)
                dst = ((page * PAGE_SIZE + pos % PAGE_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims
                k = tl.load(k_new_ptr + token * kn_stride_t + kv_head * kn_stride_h + dims, mask=dim_ok)
                v = tl.load(v_new_ptr + token * vn_stride_t + kv_head * vn_stride_h + dims, mask=dim_ok)
                tl.store(k_ptr + dst, k.to(k_ptr.dtype.element_ty), mask=dim_ok)
                tl.store(v_ptr + dst, v.to(v_ptr.dtype.element_ty), mask=dim_ok)
