"""The SwiGLU product of a fused gate|up projection, silu(gate) * up, in one pass: for steps that run eagerly
(prompt chunks, mixed steps), where the stock ops would read and write the [M, I] intermediate three times.

Rounds where the stock ops round: silu's result to the input dtype, then the product; its exponential and
division are the ones torch's CUDA kernel uses (libdevice's expf, an IEEE division).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

BLOCK = 1024


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference (the CPU path and the oracle): x [M, 2I] = gate | up -> silu(gate) * up [M, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on CUDA for rows with unit column stride, else the reference. Same signature as
    :func:`silu_mul_ref`."""
    if not (kernels.runs_kernel(x) and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return silu_mul_ref(x)
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(width, BLOCK))](x, out, width, x.stride(0), BLOCK=BLOCK,
                                                                   CUDA=x.is_cuda)
    return out


if triton is not None:
    @triton.jit
    def _silu_mul_kernel(x_ptr, y_ptr, width, stride_xm, BLOCK: tl.constexpr, CUDA: tl.constexpr):
        """One program per (row, block of columns): silu in fp32 rounded to the dtype, times up, rounded."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        dtype = y_ptr.dtype.element_ty
        gate = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_xm + width + cols, mask=ok, other=0.0).to(tl.float32)
        if CUDA:  # CUDA's expf and an IEEE division, as torch's kernel computes silu
            act = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate))
        else:  # Triton's CPU interpreter has neither
            act = gate / (1.0 + tl.exp(-gate))
        act = act.to(dtype).to(tl.float32)
        tl.store(y_ptr + row * width + cols, (act * up).to(dtype), mask=ok)
