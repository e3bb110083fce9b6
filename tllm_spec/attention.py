"""Attention for target and draft layers: write K/V into the paged cache, attend over it.

The target's stock HF attention modules reach :func:`hf_attention_forward` through transformers'
``AttentionInterface`` (registered as ``"tllm_spec"``); the metadata travels as the ``tllm_attn`` keyword
argument, which transformers forwards from the model call to every attention function.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .kernels.paged_attention import paged_attention
from .kv_cache import KVCache

ATTN_IMPLEMENTATION = "tllm_spec"


@dataclass(frozen=True)
class AttentionMetadata:
    """Where one forward's tokens sit in the cache.

    positions [N] int64; token_slots [N] int64 (block-table row per token); write_index [N] int64 (flat
    page slot of each token's K/V). Host values, fixed when the step is built (never read back from the
    device): ``context_lens``, the prompt lengths of the context requests, whose tokens come first and
    attend only to themselves; ``max_kv_len``, a bound on positions + 1 (limits the reference's work).
    """

    kv_cache: KVCache
    positions: torch.Tensor
    token_slots: torch.Tensor
    write_index: torch.Tensor
    max_kv_len: int
    context_lens: tuple[int, ...] = ()

    @classmethod
    def build(cls, kv_cache: KVCache, token_slots: torch.Tensor, positions: torch.Tensor, max_kv_len: int,
              context_lens: tuple[int, ...] = ()) -> AttentionMetadata:
        write_index = kv_cache.write_index(token_slots, positions)
        return cls(kv_cache, positions, token_slots, write_index, max_kv_len, tuple(context_lens))

    @property
    def num_context_tokens(self) -> int:
        return sum(self.context_lens)

    def for_tokens(self, token_slots: torch.Tensor, positions: torch.Tensor) -> AttentionMetadata:
        """Metadata for one new token per request (a draft step), same bounds, no context part."""
        return AttentionMetadata.build(self.kv_cache, token_slots, positions, self.max_kv_len)


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
           sliding_window: int | None = None) -> torch.Tensor:
    """Store k, v for this forward's tokens in ``layer`` and attend. q [N, Hq, D]; k, v [N, Hkv, D] -> [N, Hq, D].

    On the GPU, context tokens (a whole prompt each, positions from 0) attend to their own prompt with
    dense causal attention on this forward's k, v, and the other tokens read the paged cache. On the CPU the
    paged reference serves every token in one batched call (cheaper than a call per short prompt).
    """
    k_cache, v_cache = meta.kv_cache.k[layer], meta.kv_cache.v[layer]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.write_index, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.write_index, v.to(v_cache.dtype))
    num_ctx = meta.num_context_tokens
    if num_ctx == 0 or not q.is_cuda:
        return paged_attention(q.contiguous(), k_cache, v_cache, meta.kv_cache.block_tables, meta.token_slots,
                               meta.positions, scale, meta.max_kv_len, sliding_window)
    out = torch.empty_like(q)
    out[:num_ctx] = prefill_attention(q[:num_ctx], k[:num_ctx], v[:num_ctx], meta.context_lens, scale,
                                      sliding_window)
    if num_ctx < q.shape[0]:
        out[num_ctx:] = paged_attention(q[num_ctx:].contiguous(), k_cache, v_cache, meta.kv_cache.block_tables,
                                        meta.token_slots[num_ctx:], meta.positions[num_ctx:], scale,
                                        meta.max_kv_len, sliding_window)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: tuple[int, ...], scale: float,
                      sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention within each prompt of a packed batch. q [N, Hq, D]; k, v [N, Hkv, D] -> [N, Hq, D]."""
    out = torch.empty_like(q)
    start = 0
    for n in lens:
        qs, ks, vs = (x[start:start + n].transpose(0, 1)[None].to(q.dtype) for x in (q, k, v))  # [1, H, n, D]
        mask = None
        if sliding_window is not None:  # an explicit mask; plain causal keeps the flash kernels eligible
            pos = torch.arange(n, device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - sliding_window)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=qs.shape[1] != ks.shape[1])
        out[start:start + n] = o[0].transpose(0, 1)
        start += n
    return out


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
