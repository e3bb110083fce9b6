"""RMSNorm of a few rows in one launch: the stock Llama/Qwen/Mistral norm, op for op, for a decoding step.

A single request's step normalises one to K+1 rows of the hidden size; the norm is all latency (a few KB
read), so one program loads a whole row at once, reduces it and writes it back. The residual add that the
stock layer does before the norm is the previous GEMM's epilogue (:mod:`.skinny_linear`) on this path.
"""
from __future__ import annotations

import torch

from .. import kernels
from . import dependent_launch

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

MAX_WIDTH = 16384  # one program holds a row in registers


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference (the CPU path and the oracle): ``weight * (x̂ in fp32).to(x.dtype)``, the stock module's
    ops in its order. x [M, H]; weight [H] -> [M, H]."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton kernel on CUDA for bf16/fp16 rows with a weight of their dtype, else the reference. Same
    signature as :func:`rms_norm_ref`."""
    width = x.shape[-1]
    if not (kernels.runs_kernel(x) and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(1) == 1 and weight.is_contiguous() and width <= MAX_WIDTH):
        return rms_norm_ref(x, weight, eps).contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(width)
    pdl = dependent_launch.launches_dependent(x)
    _rms_norm_kernel[(x.shape[0],)](x, weight, out, width, x.stride(0), eps, BLOCK=block, PDL=pdl,
                                    num_warps=min(16, max(1, block // 512)),
                                    **dependent_launch.launch_options(pdl))
    return out


@torch.library.custom_op("tllm_spec::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` as a torch op (opaque to torch.compile). x [M, H] -> [M, H], contiguous."""
    return rms_norm(x, weight, eps)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


if triton is not None:
    from .dependent_launch import wait_and_release

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, stride_xm, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """One program per row: the mean square in fp32, x̂ rounded to the row's dtype, times the weight. PDL:
        see :mod:`.dependent_launch`."""
        if PDL:
            wait_and_release()
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        x = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, 0) * (1.0 / H) + eps)  # the mean as torch's CUDA reduction takes it
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        dtype = y_ptr.dtype.element_ty
        tl.store(y_ptr + row * H + cols, (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype), mask=ok)
