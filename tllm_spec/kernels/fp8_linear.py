"""``y = x @ dequant(weight).T (+ bias)`` with FP8 (E4M3) weights and activations: the GEMM of every FP8 linear.

The weight is stored FP8 with fp32 scales, per output channel ([N]) or per 128 x 128 block ([N/128, K/128],
fine-grained checkpoints). The activation is quantized first, as the checkpoint's scheme says (:mod:`.fp8_quant`:
per token, optionally clamped to ``scale_ub``; per token and 128 columns for block scales; or one static
``input_scale``). The product is FP8 x FP8 with fp32 accumulation, scaled in the epilogue (per K block inside the
loop for block scales), rounded to x's dtype.

Few rows (M <= ``MAX_ROWS``, a decoding step's) run :func:`_fp8_linear_kernel`: a weight-streaming GEMM like
:mod:`.skinny_linear` over the quantized rows, whose epilogue holds the SwiGLU product of a fused gate/up projection,
a residual add, or the RoPE of a fused q/k/v projection's q and k heads, as the bf16 kernel does. More rows (prompt
chunks, large batches) with channel scales and 16-bit results are ``torch._scaled_mm`` (cuBLASLt, row-wise scales;
a rotation after it as the reference's ops); others the same Triton kernel over tiles of 32 rows. :func:`fp8_linear_ref`
is the CPU path and the oracle: it quantizes the activation as the kernels do, dequantizes both operands to fp32 and
multiplies, so a CPU model is the checkpoint's maths exactly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
from . import dependent_launch
from .fp8_quant import FP8, FP8_MAX, GROUP, quantize_activation, quantize_activation_ref
from .silu_mul import silu_mul_ref
from .skinny_linear import rotary_fits, rotate_columns_ref

__all__ = ["FP8", "FP8_MAX", "GROUP", "MAX_ROWS", "dequantize_weight", "fp8_linear", "fp8_linear_op", "fp8_linear_ref",
           "quantize_activation", "quantize_activation_ref"]

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

# Up to here the Triton kernel streams the weight; above, cuBLASLt (channel scales, 16-bit activations). Measured on
# an H200, 8B shapes, rows FP8 already (scripts/bench_fp8_linear.py --rows 48 64 256 --quantized --row-tile-64
# --cublas, docs/benchmarks/h200-fp8): at 48 and 64 rows the kernel's 64-row tile reads 1.2-2.1x faster than
# cuBLASLt (o 2470 against 1192 GB/s, gate/up 3264 against 2603 at 64 rows); at 256 rows cuBLASLt reads faster on
# the many-feature projections (gate/up 2066 against 1526).
MAX_ROWS = 64
# Bytes of each weight row a program asks L2 for before it waits for the kernel in front (dependent_launch): that
# kernel (the activation quantization, a norm) is all latency and leaves the memory system idle meanwhile. On an
# H100 (scripts/bench_fp8_linear.py --rows 1 8 --tiles chosen --prefetch 0 512 1024 2048 4096), 512 reads 2-4 %
# faster than none at 1 row on every 8B projection (o 1594 -> 1652 GB/s); 2048 and more are slower than none.
PREFETCH_BYTES = 512


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None = None
                      ) -> torch.Tensor:
    """FP8 weight [N, K] with scales [N] (per channel) or [ceil(N / bn), ceil(K / bk)] (``block`` = (bn, bk)) ->
    fp32 [N, K]."""
    w = weight.float()
    if block is None:
        return w * weight_scale.float().reshape(-1, 1)
    bn, bk = block
    scale = weight_scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return w * scale[:w.shape[0], :w.shape[1]]


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                   input_scale: torch.Tensor | None = None, block_scales: bool = False, scale_ub: float | None = None,
                   gated: bool = False, residual: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, rope_cos: torch.Tensor | None = None,
                   rope_sin: torch.Tensor | None = None, rotary_cols: int = 0, head_dim: int = 0) -> torch.Tensor:
    """Torch reference (the CPU path and the oracle). x [M, K] (any float dtype); weight FP8 [N, K]; weight_scale
    fp32 [N], or [ceil(N/128), ceil(K/128)] with ``block_scales`` (the activation then quantized per 128 columns);
    ``input_scale``: a static activation scale; bias [N] -> y [M, N] in x's dtype (``gated``: silu(y[:, :N/2]) *
    y[:, N/2:] [M, N/2]; ``residual``: plus it, rounded as eager torch's ``residual + y``). ``x_scale`` [M, 1]:
    x is FP8 already, quantized per token with these scales (:func:`~.rms_norm.rms_norm_fp8`), and y is
    ``out_dtype``. ``rope_cos``, ``rope_sin`` [M, D]: y[:, :rotary_cols] rotated per head of ``head_dim``
    (:func:`~.skinny_linear.rotate_columns_ref`)."""
    x_q, x_scale, dtype = _activation(x, x_scale, out_dtype, input_scale, block_scales, scale_ub,
                                      quantize_activation_ref)
    rows, cols = x.shape
    x_dq = (x_q.float().view(rows, x_scale.shape[1], -1) * x_scale[..., None]).view(rows, cols)
    w_dq = dequantize_weight(weight, weight_scale, (GROUP, GROUP) if block_scales else None)
    y = F.linear(x_dq, w_dq, None if bias is None else bias.float()).to(dtype)
    if gated:
        y = silu_mul_ref(y)
    if rope_cos is not None:
        y = rotate_columns_ref(y, rope_cos, rope_sin, rotary_cols, head_dim)
    return y if residual is None else residual + y


def _activation(x, x_scale, out_dtype, input_scale, block_scales, scale_ub, quantize):
    """(FP8 rows, their scales, the result's dtype): x quantized by ``quantize`` as the scheme says, or as given."""
    if x_scale is None:
        return (*quantize(x, input_scale, GROUP if block_scales else 0, scale_ub), x.dtype)
    if x.dtype != FP8 or out_dtype is None or block_scales or x_scale.shape != (x.shape[0], 1):
        raise ValueError("fp8_linear: quantized rows come as FP8 with one scale per row [M, 1] and an out_dtype, "
                         "for channel-scaled weights")
    return x, x_scale, out_dtype


def tile_config(n: int, k: int, tile_rows: int, block_scales: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an FP8 [n, k] weight and the row tile (:func:`row_tile`), from
    ``scripts/bench_fp8_linear.py --quantized`` on an H200 (Llama-3.1-8B shapes): tiles of 16 and 32 rows, many
    output features (qkv, gate/up) 512 B of each weight row per stage, three deep; few (o, down, the EAGLE-3 fc) six
    deep (o at 1 row 1885 -> 2287 GB/s, down 2765 -> 3033 against the H100's two warps four deep in 1 KB tiles). The
    64-row tile takes 256 B a stage, six deep, and 128 features a program with the most features (gate/up). Block
    scales fix BLOCK_K at the block's 128."""
    if block_scales:
        return (32 if n <= 4096 else 64), GROUP, 4, 4
    if tile_rows == 64:
        return (32, 256, 4, 6) if n <= 4096 else (128, 128, 4, 3) if n >= 16384 else (64, 256, 4, 6)
    if n <= 4096:
        return 32, 512, 4, 6
    return 64, 512, 4, 3


def row_tile(rows: int, wide: bool) -> int:
    """The kernel's row tile: 16 up to 16 rows, else 32, and 64 for 33 to MAX_ROWS rows of a ``wide`` GEMM (16-bit
    results of channel-scaled weights: cuBLASLt takes them above MAX_ROWS). The others (block scales, fp32 results)
    run any number of rows as tiles of 32, next to each other in the launch order, so a weight tile is read from
    memory once and from L2 by the others. The 16- and 32-row tiles' FP8 dot is the warp-level MMA, the 64-row
    tile's Hopper's warpgroup MMA, whose sums round differently: a row's result is the same whatever the number of
    rows beside it up to 32 rows, and at any count where the GEMM is not wide (a verify step's rows and its plain
    step's agree); a wide one's rows from 33 on round as the 64-row tile, then as cuBLASLt (as the bf16 path's
    round as cuBLAS past its own bound)."""
    if rows <= 16:
        return 16
    return 64 if wide and 32 < rows <= MAX_ROWS else 32


def supports(x: torch.Tensor, weight: torch.Tensor, block_scales: bool) -> bool:
    """Whether :func:`fp8_linear` runs a kernel (Triton or cuBLASLt) for these operands, not the reference."""
    return (kernels.runs_kernel(x) and x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32, FP8)
            and (not block_scales or x.shape[1] % GROUP == 0))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
               input_scale: torch.Tensor | None = None, block_scales: bool = False, scale_ub: float | None = None,
               gated: bool = False, residual: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, rope_cos: torch.Tensor | None = None,
               rope_sin: torch.Tensor | None = None, rotary_cols: int = 0, head_dim: int = 0,
               config: tuple[int, int, int, int] | None = None, prefetch: int | None = None) -> torch.Tensor:
    """The kernels where :func:`supports` says so, else the reference. Same signature as :func:`fp8_linear_ref`;
    ``config`` = (BLOCK_N, BLOCK_K, num_warps, num_stages) of the Triton kernel, default :func:`tile_config`;
    ``prefetch``: bytes of each weight row asked of L2 before the wait, default PREFETCH_BYTES. The rotation is
    the Triton kernel's epilogue where :func:`~.skinny_linear.rotary_fits`, else the reference's ops after."""
    rope = {"rope_cos": rope_cos, "rope_sin": rope_sin, "rotary_cols": rotary_cols, "head_dim": head_dim}
    if not supports(x, weight, block_scales):
        return fp8_linear_ref(x, weight, weight_scale, bias, input_scale, block_scales, scale_ub, gated, residual,
                              x_scale, out_dtype, **rope)
    rows, (n, k) = x.shape[0], weight.shape
    dtype = x.dtype if x_scale is None else out_dtype
    wide = not block_scales and _scaled_mm_fits(dtype, weight)
    cublas = wide and rows > MAX_ROWS
    tile_rows = row_tile(rows, wide)
    block_n, block_k, num_warps, num_stages = config or tile_config(n, k, tile_rows, block_scales)
    if rope_cos is not None and (cublas or not rotary_fits(rows, n, dtype, gated, rope_cos, rope_sin, rotary_cols,
                                                           block_n, head_dim)):
        y = fp8_linear(x, weight, weight_scale, bias, input_scale, block_scales, scale_ub, gated, None, x_scale,
                       out_dtype, config=config, prefetch=prefetch)
        y = rotate_columns_ref(y, rope_cos, rope_sin, rotary_cols, head_dim)
        return y if residual is None else residual + y
    x_q, x_scale, dtype = _activation(x, x_scale, out_dtype, input_scale, block_scales, scale_ub,
                                      quantize_activation)
    if cublas:
        return _cublas(x_q, x_scale, weight, weight_scale, bias, dtype, gated, residual)
    out = torch.empty(rows, n // 2 if gated else n, dtype=dtype, device=x.device)
    pdl = dependent_launch.launches_dependent(x)
    prefetch = min(triton.next_power_of_2(k), PREFETCH_BYTES if prefetch is None else prefetch) if pdl else 0
    prefetch = prefetch if prefetch >= 128 else 0  # whole 128-byte lines
    grid = (triton.cdiv(rows, tile_rows), triton.cdiv(out.shape[1], block_n // 2 if gated else block_n))
    rotary = rope_cos is not None
    _fp8_linear_kernel[grid](
        x_q, x_scale, weight, weight_scale, bias if bias is not None else weight_scale,
        residual if residual is not None else out, out, rope_cos if rotary else out, rope_sin if rotary else out,
        rows, out.shape[1], k, x_scale.stride(0), out.stride(0), 0 if residual is None else residual.stride(0),
        weight_scale.stride(0) if block_scales else 0, rope_cos.stride(0) if rotary else 0,
        rope_sin.stride(0) if rotary else 0, rotary_cols if rotary else 0,
        HAS_BIAS=bias is not None, GATED=gated, HAS_RESIDUAL=residual is not None, BLOCK_SCALES=block_scales,
        ROTARY=rotary, HALF_HEAD=rope_cos.shape[-1] // 2 if rotary else 1,
        HEAD=(head_dim or rope_cos.shape[-1]) if rotary else 2, ROWS=tile_rows, BLOCK_N=block_n,
        BLOCK_K=block_k, PREFETCH=prefetch, PDL=pdl, num_warps=num_warps, num_stages=num_stages,
        enable_fp_fusion=False,  # no FMA contraction: the rotation rounds each product and sum as eager torch
        # does (as the bf16 kernel's), and the rest of the kernel rounds the same with or without the epilogue
        **dependent_launch.launch_options(pdl))
    return out


def _scaled_mm_fits(dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """cuBLASLt's FP8 GEMM wants 16-aligned sizes and a half-precision output."""
    return dtype in (torch.bfloat16, torch.float16) and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def _cublas(x_q, x_scale, weight, weight_scale, bias, dtype, gated, residual) -> torch.Tensor:
    """Many rows, channel scales: the quantized rows through cuBLASLt with row-wise scales (fp32 [M, 1] x
    [1, N])."""
    y = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.float().reshape(1, -1),
                         bias=bias, out_dtype=dtype)
    if gated:
        y = silu_mul_ref(y)
    return y if residual is None else residual + y


@torch.library.custom_op("tllm_spec::fp8_linear", mutates_args=())
def fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                  input_scale: torch.Tensor | None = None, block_scales: bool = False, scale_ub: float | None = None,
                  gated: bool = False, residual: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, rope_cos: torch.Tensor | None = None,
                  rope_sin: torch.Tensor | None = None, rotary_cols: int = 0, head_dim: int = 0) -> torch.Tensor:
    """:func:`fp8_linear` as a torch op (opaque to torch.compile). x [M, K] -> [M, N] (gated: N/2)."""
    return fp8_linear(x, weight, weight_scale, bias, input_scale, block_scales, scale_ub, gated, residual, x_scale,
                      out_dtype, rope_cos, rope_sin, rotary_cols, head_dim)


@fp8_linear_op.register_fake
def _(x, weight, weight_scale, bias, input_scale=None, block_scales=False, scale_ub=None, gated=False, residual=None,
      x_scale=None, out_dtype=None, rope_cos=None, rope_sin=None, rotary_cols=0, head_dim=0):
    return x.new_empty(x.shape[0], weight.shape[0] // 2 if gated else weight.shape[0],
                       dtype=x.dtype if x_scale is None else out_dtype)


if triton is not None:
    from .dependent_launch import prefetch_l2, wait_and_release
    from .skinny_linear import finish_rows, store_rows, weight_rows

    @triton.jit
    def _fp8_linear_kernel(q_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, r_ptr, y_ptr, cos_ptr, sin_ptr, M, N, K, stride_xs,
                           stride_ym, stride_rm, stride_ws, stride_cm, stride_sm, rotary_cols,
                           HAS_BIAS: tl.constexpr, GATED: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                           BLOCK_SCALES: tl.constexpr, ROTARY: tl.constexpr, HALF_HEAD: tl.constexpr,
                           HEAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PREFETCH: tl.constexpr, PDL: tl.constexpr):
        """One program: output features [pid_n * BLOCK_N, +BLOCK_N) (GATED: gate row f and up row N + f
        interleaved; ROTARY: below rotary_cols, the rows of each rotary pair side by side, rotated in the epilogue;
        both as in the bf16 kernel, :func:`~.skinny_linear.weight_rows`) of rows [pid_m * ROWS, +ROWS), the whole
        of K (axis 0 of the grid is the row tile: the programs of one weight tile run next to each other). q: the
        FP8 rows [M, K], xs their scales [M, 1] or [M, K / 128] (BLOCK_SCALES, BLOCK_K = 128: each K tile's partial
        product scaled by its activation group's and weight block's scales). PREFETCH: bytes of each weight row
        asked of L2 before the wait (PDL)."""
        pid_n = tl.program_id(1)
        offs_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        offs_k = tl.arange(0, BLOCK_K)
        w_row, mask_n = weight_rows(pid_n, N, rotary_cols, GATED, ROTARY, HALF_HEAD, HEAD, BLOCK_N)
        mask_m = offs_m < M
        q_rows = q_ptr + offs_m[:, None].to(tl.int64) * K
        w_rows = w_ptr + w_row[:, None].to(tl.int64) * K
        if PREFETCH > 0:
            lines = tl.arange(0, PREFETCH // 128) * 128
            prefetch_l2(w_rows + lines[None, :], mask_n[:, None] & (lines < K)[None, :])
        if PDL:
            wait_and_release()
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        if BLOCK_SCALES:
            ws_rows = ws_ptr + (w_row // BLOCK_K) * stride_ws
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + offs_k
                x = tl.load(q_rows + ks[None, :], mask=mask_m[:, None] & (ks < K)[None, :], other=0.0)
                w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & (ks < K)[None, :], other=0.0,
                            eviction_policy="evict_first")
                x_scale = tl.load(xs_ptr + offs_m * stride_xs + k0 // BLOCK_K, mask=mask_m, other=0.0)
                w_scale = tl.load(ws_rows + k0 // BLOCK_K, mask=mask_n, other=0.0)
                acc += tl.dot(x, tl.trans(w)) * x_scale[:, None] * w_scale[None, :]
        else:
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + offs_k
                x = tl.load(q_rows + ks[None, :], mask=mask_m[:, None] & (ks < K)[None, :], other=0.0)
                w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & (ks < K)[None, :], other=0.0,
                            eviction_policy="evict_first")
                acc = tl.dot(x, tl.trans(w), acc)
            x_scale = tl.load(xs_ptr + offs_m * stride_xs, mask=mask_m, other=0.0)
            w_scale = tl.load(ws_ptr + w_row, mask=mask_n, other=0.0)
            acc = acc * x_scale[:, None] * w_scale[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + w_row, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        y, offs_n = finish_rows(acc, y_ptr.dtype.element_ty, pid_n, w_row, offs_m, mask_m, cos_ptr, sin_ptr,
                                stride_cm, stride_sm, rotary_cols, GATED, ROTARY, HALF_HEAD, HEAD, ROWS, BLOCK_N)
        store_rows(y, y_ptr, r_ptr, offs_m, offs_n, mask_m, N, stride_ym, stride_rm, HAS_RESIDUAL)
