"""Rotary position embedding (RoPE): the stock HF rotation, and a table of its cos/sin per position."""
from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryTable(nn.Module):
    """cos/sin of every position up to ``max_positions``, computed once the way the stock rotary module does
    (fp32 angles, ``attention_scaling``, cast to the model dtype); a forward is a row gather."""

    STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.attention_scaling, self.dtype = attention_scaling, dtype
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.resize(max_positions)

    @classmethod
    def from_hf(cls, rotary: nn.Module, max_positions: int, dtype: torch.dtype) -> RotaryTable:
        """From a stock HF rotary-embedding module (its ``inv_freq`` and ``attention_scaling``)."""
        return cls(rotary.inv_freq, rotary.attention_scaling, max_positions, dtype)

    def resize(self, max_positions: int) -> None:
        positions = torch.arange(max_positions, device=self.inv_freq.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.attention_scaling).to(self.dtype)
        self.sin = (emb.sin() * self.attention_scaling).to(self.dtype)

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] int64 -> (cos, sin) [N, 1, D] (broadcast over heads)."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]; cos, sin [N, 1, D]."""
    return x * cos + rotate_half(x) * sin
