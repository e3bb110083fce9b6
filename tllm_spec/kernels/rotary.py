"""Rotary position embedding of many tokens in one pass: for steps that run eagerly (prompt chunks, mixed steps),
where the stock rotation (x * cos + rotate_half(x) * sin) is five kernels and as many passes over q and k.

Rounds where the stock ops round (each product to bf16, then the sum), so the result is the stock one. Every
rounding is bit arithmetic (ties to even), the final cast then exact: a plain cast between a product and the sum
is what the GPU compiler may fuse away (one FMA, one rounding: one ulp off the stock result in about a tenth of
the elements), and the interpreter's casts do not round to nearest.
"""
from __future__ import annotations

import torch

from .. import kernels
from ..model.rotary import apply_rotary

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

BLOCK_HEADS = 4


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Torch reference (the CPU path and the oracle): x [N, heads, D]; cos, sin [N, 1, D] -> [N, heads, D]."""
    return apply_rotary(x, cos, sin)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on CUDA for bf16 (x's heads may be a strided slice of a wider row: q|k of a qkv
    projection), else the reference. Same signature as :func:`rotary_ref`; the result is contiguous."""
    num_tokens, num_heads, dim = x.shape
    if not (kernels.runs_kernel(x) and x.stride(2) == 1 and dim % 2 == 0 and cos.shape == sin.shape
            and cos.shape == (num_tokens, 1, dim) and cos.stride(2) == sin.stride(2) == 1
            and cos.stride(0) == sin.stride(0) and x.dtype == cos.dtype == sin.dtype == torch.bfloat16):
        return rotary_ref(x, cos, sin)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens:
        half = dim // 2
        _rotary_kernel[(num_tokens, triton.cdiv(num_heads, BLOCK_HEADS))](
            x, cos, sin, out, num_heads, x.stride(0), x.stride(1), cos.stride(0), HALF=half,
            BLOCK_D=triton.next_power_of_2(half), BLOCK_HEADS=BLOCK_HEADS)
    return out


if triton is not None:
    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, num_heads, stride_xn, stride_xh, stride_cn,
                       HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HEADS: tl.constexpr):
        """One program per (token, block of heads): both halves of each head, the products rounded to bf16
        before their sum as the stock ops round them."""
        token = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        d = tl.arange(0, BLOCK_D)
        ok = (heads[:, None] < num_heads) & (d[None, :] < HALF)
        dtype = y_ptr.dtype.element_ty
        x = x_ptr + token * stride_xn + heads[:, None] * stride_xh + d[None, :]
        x1 = tl.load(x, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x + HALF, mask=ok, other=0.0).to(tl.float32)
        table = token * stride_cn + d
        cos1 = tl.load(cos_ptr + table, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        cos2 = tl.load(cos_ptr + table + HALF, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        sin1 = tl.load(sin_ptr + table, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        sin2 = tl.load(sin_ptr + table + HALF, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        first = _round_to_bf16(x1 * cos1) - _round_to_bf16(x2 * sin1)
        second = _round_to_bf16(x2 * cos2) + _round_to_bf16(x1 * sin2)
        y = y_ptr + token * num_heads * (2 * HALF) + heads[:, None] * (2 * HALF) + d[None, :]
        tl.store(y, _round_to_bf16(first).to(dtype), mask=ok)  # already bf16 values: the cast is exact
        tl.store(y + HALF, _round_to_bf16(second).to(dtype), mask=ok)

    @triton.jit
    def _round_to_bf16(v):
        """fp32 -> the nearest bf16 value (ties to even), still fp32 (finite v)."""
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
