"""Counter-based uniform draws in one launch: :mod:`tllm_spec.sampling.rng`'s hash, element by element.

The reference is the hash in int64 torch ops (about 60 of them, each a kernel over the whole draw); the kernel
computes the same 32-bit arithmetic in uint32 registers (products wrap modulo 2**32 where the reference masks
them), so its numbers are the reference's bit for bit. Inside a compiled step the draw is one opaque op
(``tllm_spec::uniform``): Inductor would fold the hash's 32-bit multipliers into int32 index arithmetic, which
overflows; through this kernel the op is one launch in the step's graph instead of sixty.
"""
from __future__ import annotations

import math

import torch

from .. import kernels

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

_MASK32 = 0xFFFFFFFF
BLOCK = 1024  # draws a program makes
MAX_PER_KEY = 2**31 - BLOCK  # the kernel's element index is int32, its last block's too (the reference's high
# half, index >> 32, is then 0)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on the low 32 bits of an int64 tensor (products wrap; we keep 32 bits)."""
    x = x & _MASK32
    x = (x ^ (x >> 16)) * 0x7FEB352D & _MASK32
    x = (x ^ (x >> 15)) * 0x846CA68B & _MASK32
    return x ^ (x >> 16)


def _per_key(seed: torch.Tensor, offset: torch.Tensor, shape: tuple[int, ...]) -> int:
    """Draws per stream: a row's (one stream per row) or the whole draw's (one stream)."""
    return math.prod(shape[1:]) if seed.numel() > 1 or offset.numel() > 1 else math.prod(shape)


def uniform_ref(seed: torch.Tensor, offset: torch.Tensor, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """Torch reference (the CPU path and the oracle): uniform floats in (0, 1), float32, of ``shape``.
    seed, offset: [1] int64 (one stream) or [shape[0]] int64 (one stream per row)."""
    per_key = _per_key(seed, offset, shape)
    index = torch.arange(per_key, device=seed.device, dtype=torch.int64)[None]  # [1, N]
    folded = seed ^ (seed >> 32)  # 63-bit request seeds: the high half counts too (a no-op below 2**32)
    key = _mix32(_mix32(folded * 0x9E3779B1 + salt) ^ _mix32(offset + 0x632BE5AB)).view(-1, 1)  # [1 or R, 1]
    bits = _mix32(index * 0x85EBCA6B ^ key)
    bits = _mix32(bits + (index >> 32))
    # 23 random bits, centred in their bucket: exactly representable, never 0 or 1 in float32.
    return ((bits >> 9).to(torch.float32) + 0.5).mul_(1.0 / 8388608.0).view(shape)


def uniform(seed: torch.Tensor, offset: torch.Tensor, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """The Triton kernel on CUDA, else the reference. Same signature as :func:`uniform_ref`."""
    shape = tuple(shape)
    per_key = _per_key(seed, offset, shape)
    if not kernels.runs_kernel(seed) or per_key >= MAX_PER_KEY:
        return uniform_ref(seed, offset, shape, salt)
    assert seed.dtype == offset.dtype == torch.int64 and seed.is_contiguous() and offset.is_contiguous()
    out = torch.empty(shape, dtype=torch.float32, device=seed.device)
    streams = max(seed.numel(), offset.numel())
    if out.numel():
        _uniform_kernel[(streams, triton.cdiv(per_key, BLOCK))](
            seed, offset, out, per_key, salt & _MASK32, SEED_ROWS=seed.numel() > 1, OFFSET_ROWS=offset.numel() > 1,
            BLOCK=BLOCK, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _mix32_u32(x):
        """:func:`_mix32` on uint32 (the products wrap as the reference's masks make them)."""
        x = x ^ (x >> 16)
        x = x * tl.full((), 0x7FEB352D, tl.uint32)
        x = x ^ (x >> 15)
        x = x * tl.full((), 0x846CA68B, tl.uint32)
        return x ^ (x >> 16)

    @triton.jit
    def _low32(x):
        """The low 32 bits of an int64 as uint32."""
        return (x & 0xFFFFFFFF).to(tl.uint32)

    @triton.jit(do_not_specialize=["per_key", "salt"])
    def _uniform_kernel(seed_ptr, offset_ptr, out_ptr, per_key, salt, SEED_ROWS: tl.constexpr,
                        OFFSET_ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """One program: BLOCK draws of one stream (row ``program_id(0)``; its seed and offset from the row's
        entry, or entry 0 where one value serves every row)."""
        row = tl.program_id(0)
        seed = tl.load(seed_ptr + (row if SEED_ROWS else 0))
        offset = tl.load(offset_ptr + (row if OFFSET_ROWS else 0))
        folded = _low32(seed ^ (seed >> 32))
        salted = folded * tl.full((), 0x9E3779B1, tl.uint32) + salt.to(tl.uint32)
        key = _mix32_u32(_mix32_u32(salted) ^ _mix32_u32(_low32(offset) + tl.full((), 0x632BE5AB, tl.uint32)))
        index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        bits = _mix32_u32(_mix32_u32(index.to(tl.uint32) * tl.full((), 0x85EBCA6B, tl.uint32) ^ key))
        draws = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        tl.store(out_ptr + row.to(tl.int64) * per_key + index, draws, mask=index < per_key)
