"""Training-time test (TTT): the attention a draft layer sees when it is unrolled over draft levels.

At inference a chain of drafts that starts after position t (the last accepted token) runs level 0 over the
target's features -- draft keys at every position <= t -- then one token per level: level j sits at position
t + j, writes its key there and attends every cached position <= t + j, i.e. the level-0 keys at positions
<= t and the keys of levels 1..j of its *own* chain (positions t+1 .. t+j; what other chains wrote there is
overwritten). Training runs every chain start t of a sequence at once: level j is one [B, T] pass whose row t
is chain t's level-j token, and its attention is

    row t of level j  ->  level-0 keys at rows s <= t   and   the level-i keys at row t, for i = 1..j

(SpecForge/EAGLE-3 compute the same pattern as "causal over level 0 + the diagonal of every later level").
We concatenate the levels' keys and let ``scaled_dot_product_attention`` apply :func:`ttt_attention_mask`.

The same function serves HF decoder layers (MTP blocks) through transformers' AttentionInterface as
``"tllm_spec_ttt"``: pass ``ttt_cache=TTTCache()`` to the layer call and it reaches :func:`hf_ttt_attention`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

TTT_ATTN_IMPLEMENTATION = "tllm_spec_ttt"


def ttt_attention_mask(seq_len: int, level: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[T, (level+1)*T] bool, True = may attend: block 0 causal over the level-0 keys, blocks 1..level the
    identity (each chain sees only its own deeper keys)."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    own = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [own] * level, dim=1)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float
                  ) -> torch.Tensor:
    """Level ``len(keys) - 1`` attention. q [B, Hq, T, D] (RoPE applied at positions t + level); keys[i],
    values[i] [B, Hkv, T, D], level i's keys (keys[-1] = this level's) -> [B, Hq, T, D]."""
    group = q.shape[1] // keys[0].shape[1]
    k = torch.cat(keys, dim=2).repeat_interleave(group, dim=1)  # kv head h serves q heads h*group ...
    v = torch.cat(values, dim=2).repeat_interleave(group, dim=1)
    if len(keys) == 1:
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale)
    mask = ttt_attention_mask(q.shape[2], len(keys) - 1, q.device)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)


class TTTCache:
    """The keys and values of the levels unrolled so far (one draft layer)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    @property
    def level(self) -> int:
        """The level the next :meth:`attend` call computes."""
        return len(self.keys)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Store this level's k, v [B, Hkv, T, D] and attend with q [B, Hq, T, D] -> [B, Hq, T, D]."""
        self.keys.append(k)
        self.values.append(v)
        return ttt_attention(q, self.keys, self.values, scale)


def hf_ttt_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     ttt_cache: TTTCache | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry: query [B, Hq, T, D], key/value [B, Hkv, T, D] ->
    ([B, T, Hq, D], None). The HF mask is ignored; the TTT pattern comes from ``ttt_cache``'s level."""
    if ttt_cache is None:
        raise RuntimeError("tllm_spec_ttt attention needs ttt_cache=TTTCache() in the layer call")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return ttt_cache.attend(query, key, value, scale).transpose(1, 2), None


AttentionInterface.register(TTT_ATTN_IMPLEMENTATION, hf_ttt_attention)
