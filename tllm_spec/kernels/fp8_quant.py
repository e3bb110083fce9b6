"""Activation quantization to FP8 (E4M3) for the FP8 GEMM: x [M, K] -> (x_q FP8 [M, K], scales fp32 [M, G]).

Per token (G = 1: the row's absolute maximum / 448, clamped to ``scale_ub`` first when given), per token and 128
columns (G = K / 128, for 128 x 128 block-scaled weights) or with one static scale. One program per row, which
loads the whole row at once (up to ``MAX_WIDTH`` columns; wider rows are read twice in tiles): the kernel is all
latency, and a loop of dependent tile loads cost each projection of a decoding step more than its FP8 weight
saved (an H100, 8 rows: a 4096 x 14336 down projection 37.3 us with the tiled quantization, 25.4 us on rows
quantized beforehand). The GEMM then streams FP8 activations like its weight (:mod:`.fp8_linear`); quantizing
inside the GEMM made every program redo the whole row's maximum (the same projection 49.9 us).

Rounding: scale = max(amax * (1 / 448), MIN_SCALE), x_q = clamp(x * (1 / scale)) rounded to nearest; the reference
computes the same fp32 products, so kernel and reference quantize to the same bits.
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

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INV_FP8_MAX = 1.0 / FP8_MAX
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # an all-zero row quantizes to zeros, not to 0 / 0
GROUP = 128  # the K width of an activation group and of a weight block (fine-grained FP8)
MAX_WIDTH = 16384  # one program holds a row in registers (as the RMSNorm kernel)
BLOCK = 1024  # the tile of a wider row


def quantize_activation_ref(x: torch.Tensor, input_scale: torch.Tensor | None = None, group: int = 0,
                            scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (the CPU path and the oracle). x [M, K] -> (x_q FP8 [M, K], scales fp32 [M, G]) with
    x ~= x_q * scales (each scale over K / G columns): ``input_scale`` (a one-element tensor): that scale for every
    row (G = 1); else dynamic: per row (``group`` 0, G = 1, the row maximum clamped to ``scale_ub`` when given) or
    per row and ``group`` columns (G = K / group)."""
    rows, cols = x.shape
    xf = x.float().view(rows, -1, group or cols)
    if input_scale is not None:
        scale = input_scale.float().reshape(1, 1).expand(rows, xf.shape[1])
    else:
        amax = xf.abs().amax(dim=-1)
        if scale_ub is not None:
            amax = amax.clamp(max=scale_ub)
        scale = (amax * INV_FP8_MAX).clamp(min=MIN_SCALE)
    x_q = (xf * torch.reciprocal(scale)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x_q.view(rows, cols), scale.contiguous()


def quantize_activation(x: torch.Tensor, input_scale: torch.Tensor | None = None, group: int = 0,
                        scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on CUDA (rows of unit column stride), else the reference. Same signature."""
    if not (kernels.runs_kernel(x) and x.dim() == 2 and x.stride(1) == 1 and x.shape[0] > 0
            and (not group or x.shape[1] % group == 0)):
        return quantize_activation_ref(x, input_scale, group, scale_ub)
    rows, cols = x.shape
    x_q = torch.empty(rows, cols, dtype=FP8, device=x.device)
    scale = torch.empty(rows, cols // group if group else 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(cols) if cols <= MAX_WIDTH else BLOCK
    pdl = dependent_launch.launches_dependent(x)
    _quantize_kernel[(rows,)](x, x_q, scale, input_scale if input_scale is not None else scale, cols, x.stride(0),
                              float(scale_ub or 0.0), STATIC=input_scale is not None, HAS_UB=scale_ub is not None,
                              GROUPED=bool(group), BLOCK=max(block, GROUP), WHOLE_ROW=cols <= MAX_WIDTH, PDL=pdl,
                              num_warps=min(16, max(1, block // 512)), **dependent_launch.launch_options(pdl))
    return x_q, scale


if triton is not None:
    from .dependent_launch import wait_and_release

    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_xm, scale_ub, STATIC: tl.constexpr,
                         HAS_UB: tl.constexpr, GROUPED: tl.constexpr, BLOCK: tl.constexpr, WHOLE_ROW: tl.constexpr,
                         PDL: tl.constexpr):
        """One program per row. WHOLE_ROW: the row is one BLOCK, loaded once; else tiles of BLOCK, read twice
        (maximum, then quantize). GROUPED: each BLOCK is BLOCK / 128 groups, each its own scale."""
        row = tl.program_id(0).to(tl.int64)
        x_row, q_row = x_ptr + row * stride_xm, q_ptr + row * K
        offs = tl.arange(0, BLOCK)
        if PDL:
            wait_and_release()
        if GROUPED:
            groups: tl.constexpr = BLOCK // 128
            for k0 in range(0, K, BLOCK):
                ks = k0 + offs
                x = tl.reshape(tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32), (groups, 128))
                scale = tl.maximum(tl.max(tl.abs(x), axis=1) * (1.0 / 448.0), 1.0 / (448.0 * 512.0))
                q = to_fp8(x, tl.math.div_rn(1.0, scale)[:, None])
                tl.store(q_row + ks, tl.reshape(q, (BLOCK,)), mask=ks < K)
                g = k0 // 128 + tl.arange(0, groups)
                tl.store(s_ptr + row * (K // 128) + g, scale, mask=g < K // 128)
        elif WHOLE_ROW:
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            scale = row_scale(tl.max(tl.abs(x), axis=0), static_ptr, scale_ub, STATIC, HAS_UB)
            tl.store(q_row + offs, to_fp8(x, tl.math.div_rn(1.0, scale)),
                     mask=offs < K)
            tl.store(s_ptr + row, scale)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            if not STATIC:
                for k0 in range(0, K, BLOCK):
                    ks = k0 + offs
                    amax = tl.maximum(amax, tl.abs(tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)))
            scale = row_scale(tl.max(amax, axis=0), static_ptr, scale_ub, STATIC, HAS_UB)
            inv = tl.math.div_rn(1.0, scale)
            for k0 in range(0, K, BLOCK):
                ks = k0 + offs
                x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
                tl.store(q_row + ks, to_fp8(x, inv), mask=ks < K)
            tl.store(s_ptr + row, scale)

    @triton.jit
    def row_scale(row_max, static_ptr, scale_ub, STATIC: tl.constexpr, HAS_UB: tl.constexpr):
        """A row's scale: the static one, else its maximum (clamped to ``scale_ub``) / 448, at least MIN_SCALE
        (the RMSNorm kernel's FP8 output takes it too)."""
        if STATIC:
            return tl.load(static_ptr).to(tl.float32)
        if HAS_UB:
            row_max = tl.minimum(row_max, scale_ub)
        return tl.maximum(row_max * (1.0 / 448.0), 1.0 / (448.0 * 512.0))

    @triton.jit
    def to_fp8(x, inv_scale):
        """fp32 values times the inverse scale, clamped to E4M3's range and rounded to nearest: the rounding every
        activation quantization here shares (the reference's)."""
        return tl.clamp(x * inv_scale, -448.0, 448.0).to(tl.float8e4nv)
