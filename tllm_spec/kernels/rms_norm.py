"""RMSNorm of a few rows in one launch: the stock Llama/Qwen/Mistral norm, op for op, for a decoding step.

A single request's step normalises one to K+1 rows of the hidden size; the norm is all latency (a few KB
read), so one program loads a whole row at once, reduces it and writes it back. The residual add that the
stock layer does before the norm is the previous GEMM's epilogue (:mod:`.skinny_linear`) on this path.

:func:`rms_norm_fp8` is the norm in front of an FP8 projection with per-token activation scales: the same kernel
quantizes the row it holds (:mod:`.fp8_quant`'s rounding) and writes FP8 rows and their scales, so no
quantization kernel runs between the norm and the GEMM.
"""
from __future__ import annotations

import torch

from .. import kernels
from . import dependent_launch
from .fp8_quant import FP8, quantize_activation_ref

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
    if not _runs_kernel(x, weight):
        return rms_norm_ref(x, weight, eps).contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, weight, eps, out)
    return out


def _runs_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (kernels.runs_kernel(x) and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(1) == 1 and weight.is_contiguous() and x.shape[-1] <= MAX_WIDTH)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, scale: torch.Tensor | None = None,
            scale_ub: float | None = None) -> None:
    """One program per row; ``scale`` given: ``out`` is FP8 and ``scale`` takes each row's scale."""
    block = triton.next_power_of_2(x.shape[-1])
    pdl = dependent_launch.launches_dependent(x)
    _rms_norm_kernel[(x.shape[0],)](x, weight, out, out if scale is None else scale, x.shape[-1], x.stride(0), eps,
                                    float(scale_ub or 0.0), BLOCK=block, QUANT=scale is not None,
                                    HAS_UB=scale_ub is not None, PDL=pdl, num_warps=min(16, max(1, block // 512)),
                                    **dependent_launch.launch_options(pdl))


def rms_norm_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, scale_ub: float | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: :func:`rms_norm_ref`'s rows quantized per token (``quantize_activation_ref``) ->
    (FP8 [M, H], fp32 scales [M, 1])."""
    return quantize_activation_ref(rms_norm_ref(x, weight, eps), None, 0, scale_ub)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, scale_ub: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel where :func:`rms_norm` runs it, else the reference. Same signature as
    :func:`rms_norm_fp8_ref`."""
    if not _runs_kernel(x, weight):
        return rms_norm_fp8_ref(x, weight, eps, scale_ub)
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    _launch(x, weight, eps, q, scale, scale_ub)
    return q, scale


@torch.library.custom_op("tllm_spec::rms_norm_fp8", mutates_args=())
def rms_norm_fp8_op(x: torch.Tensor, weight: torch.Tensor, eps: float, scale_ub: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm_fp8` as a torch op (opaque to torch.compile)."""
    return rms_norm_fp8(x, weight, eps, scale_ub)


@rms_norm_fp8_op.register_fake
def _(x, weight, eps, scale_ub=None):
    return x.new_empty(x.shape, dtype=FP8), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@torch.library.custom_op("tllm_spec::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` as a torch op (opaque to torch.compile). x [M, H] -> [M, H], contiguous."""
    return rms_norm(x, weight, eps)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


if triton is not None:
    from .dependent_launch import wait_and_release
    from .fp8_quant import row_scale, to_fp8

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, s_ptr, H, stride_xm, eps, scale_ub, BLOCK: tl.constexpr,
                         QUANT: tl.constexpr, HAS_UB: tl.constexpr, PDL: tl.constexpr):
        """One program per row: the mean square in fp32, x̂ rounded to the row's dtype, times the weight. QUANT:
        that row quantized to FP8 per token (y FP8, its scale to s). PDL: see :mod:`.dependent_launch`."""
        if PDL:
            wait_and_release()
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        x = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
        y = normed_row(x, w_ptr, cols, ok, H, eps)
        if QUANT:
            yf = y.to(tl.float32)
            scale = row_scale(tl.max(tl.abs(yf), axis=0), s_ptr, scale_ub, False, HAS_UB)
            tl.store(y_ptr + row * H + cols, to_fp8(yf, tl.math.div_rn(1.0, scale)), mask=ok)
            tl.store(s_ptr + row, scale)
        else:
            tl.store(y_ptr + row * H + cols, y, mask=ok)

    @triton.jit
    def normed_row(x, w_ptr, cols, ok, H, eps):
        """A row x (fp32, zeros past H) normalised: the mean square in fp32, x̂ rounded to the weight's dtype (the
        row's), times the weight, in that dtype (the stock module's ops; the Lamport all-reduce's norm too)."""
        rstd = tl.math.rsqrt(tl.sum(x * x, 0) * (1.0 / H) + eps)  # the mean as torch's CUDA reduction takes it
        dtype = w_ptr.dtype.element_ty
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        return (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype)
