"""Attention for target and draft layers: write K/V into the paged cache, attend over it.

The target's stock HF attention modules reach :func:`hf_attention_forward` through transformers'
``AttentionInterface`` (registered as ``"tllm_spec"``); the metadata travels as the ``tllm_attn`` keyword
argument, which transformers forwards from the model call to every attention function.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from .kernels.paged_attention import paged_attention
from .kv_cache import KVCache

ATTN_IMPLEMENTATION = "tllm_spec"


@dataclass(frozen=True)
class AttentionMetadata:
    """Where one forward's tokens sit in the cache. Device tensors only, except the host bound max_kv_len.

    positions [N] int64; token_slots [N] int64 (block-table row per token); write_index [N] int64 (flat
    page slot of each token's K/V); max_kv_len: bound on positions + 1 for this forward (limits work only).
    """

    kv_cache: KVCache
    positions: torch.Tensor
    token_slots: torch.Tensor
    write_index: torch.Tensor
    max_kv_len: int

    @classmethod
    def build(cls, kv_cache: KVCache, token_slots: torch.Tensor, positions: torch.Tensor,
              max_kv_len: int) -> AttentionMetadata:
        return cls(kv_cache, positions, token_slots, kv_cache.write_index(token_slots, positions), max_kv_len)

    def for_tokens(self, token_slots: torch.Tensor, positions: torch.Tensor) -> AttentionMetadata:
        """Metadata for other tokens of the same requests (a draft step), same bounds."""
        return AttentionMetadata.build(self.kv_cache, token_slots, positions, self.max_kv_len)


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
           sliding_window: int | None = None) -> torch.Tensor:
    """Store k, v for this forward's tokens in ``layer`` and attend. q [N, Hq, D]; k, v [N, Hkv, D] -> [N, Hq, D]."""
    k_cache, v_cache = meta.kv_cache.k[layer], meta.kv_cache.v[layer]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.write_index, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.write_index, v.to(v_cache.dtype))
    return paged_attention(q, k_cache, v_cache, meta.kv_cache.block_tables, meta.token_slots, meta.positions,
                           scale, meta.max_kv_len, sliding_window)


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
