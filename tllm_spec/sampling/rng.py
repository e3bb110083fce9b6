"""Counter-based random numbers from device-resident (seed, offset) tensors.

Every draw is a pure function of (seed, offset, salt, element index), so it needs no host RNG state,
works inside a CUDA graph (the tensors are read on the device) and is identical on CPU and GPU.

Two layouts: ``seed``/``offset`` of shape [1] make one stream over the whole draw (element index = flat
index; the batch stream); of shape [R] (R = ``shape[0]``) one stream per row (element index = index within
the row), so a row's numbers do not depend on which other rows are drawn with it — what per-request seeds
need. With one row the two coincide.
"""
from __future__ import annotations

import math

import torch

_MASK32 = 0xFFFFFFFF
_SEED_MODULUS = 2**31


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on the low 32 bits of an int64 tensor (products wrap; we keep 32 bits)."""
    x = x & _MASK32
    x = (x ^ (x >> 16)) * 0x7FEB352D & _MASK32
    x = (x ^ (x >> 15)) * 0x846CA68B & _MASK32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, offset: torch.Tensor, shape: tuple[int, ...], salt: int = 0) -> torch.Tensor:
    """Uniform floats in (0, 1), float32, of ``shape``, on ``seed``'s device.

    seed, offset: [1] int64 (one stream) or [shape[0]] int64 (one stream per row), device tensors.
    ``salt`` separates independent streams of one step. Inside torch.compile the draw is one opaque op:
    Inductor would fold the hash's 32-bit multipliers into int32 index arithmetic, which overflows.
    """
    if torch.compiler.is_compiling():
        return torch.ops.tllm_spec.uniform(seed, offset, list(shape), salt)
    return _uniform(seed, offset, tuple(shape), salt)


def _uniform(seed: torch.Tensor, offset: torch.Tensor, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    per_key = math.prod(shape[1:]) if seed.numel() > 1 or offset.numel() > 1 else math.prod(shape)
    index = torch.arange(per_key, device=seed.device, dtype=torch.int64)[None]  # [1, N]
    folded = seed ^ (seed >> 32)  # 63-bit request seeds: the high half counts too (a no-op below 2**32)
    key = _mix32(_mix32(folded * 0x9E3779B1 + salt) ^ _mix32(offset + 0x632BE5AB)).view(-1, 1)  # [1 or R, 1]
    bits = _mix32(index * 0x85EBCA6B ^ key)
    bits = _mix32(bits + (index >> 32))
    # 23 random bits, centred in their bucket: exactly representable, never 0 or 1 in float32.
    return ((bits >> 9).to(torch.float32) + 0.5).mul_(1.0 / 8388608.0).view(shape)


@torch.library.custom_op("tllm_spec::uniform", mutates_args=())
def _uniform_op(seed: torch.Tensor, offset: torch.Tensor, shape: list[int], salt: int) -> torch.Tensor:
    return _uniform(seed, offset, tuple(shape), salt)


@_uniform_op.register_fake
def _(seed, offset, shape, salt):
    return seed.new_empty(shape, dtype=torch.float32)


def advance(seed: torch.Tensor) -> None:
    """Move to a fresh stream in place (graph-safe): seed <- (seed + 1) mod 2**31."""
    seed.add_(1).remainder_(_SEED_MODULUS)
