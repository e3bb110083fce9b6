"""The q and k heads of a fused q|k|v projection normalised per head (Qwen3's and GLM-4.5's q/k RMSNorm) and
rotated (RoPE) in one launch, for a decoding step's few rows.

Compiled, the stock ops became two Inductor kernels per layer (q, then k: 3.1 and 1.4 us on an H200 at one row of
the Qwen3-30B-A3B shape), between the q|k|v GEMM and the attention, outside the chain of programmatic dependent
launches (:mod:`.dependent_launch`). Here one program takes a few heads of one token: the mean square of each
head in fp32, x̂ rounded to bf16, times the head's norm weight (rounded), then the first W features of the head
rotated (a partial rotary embedding's W < D: the rest passes), each product and sum rounded where the stock
ops round them (bit arithmetic, ties to even, as :mod:`.rotary`). bf16 only; q and k come out as one
``[M, Hq + Hkv, D]`` tensor.
"""
from __future__ import annotations

import torch

from .. import kernels
from ..model.rotary import apply_rotary
from . import dependent_launch
from .rms_norm import rms_norm_ref

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

BLOCK_HEADS = 4


def qk_norm_rotary_ref(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Torch reference (the CPU path and the oracle), the stock ops. qkv [M, (Hq + 2 Hkv) * D]; q_weight, k_weight
    [D] (the q and k norms' weights, eps theirs); cos, sin [M, W], W <= D -> [M, Hq + Hkv, D]: the q heads, then the
    k heads, each normalised, then its first W features rotated."""
    rows, dim = qkv.shape[0], q_weight.shape[0]
    q = rms_norm_ref(qkv[:, :num_heads * dim].reshape(-1, dim), q_weight, eps).view(rows, num_heads, dim)
    k = rms_norm_ref(qkv[:, num_heads * dim:(num_heads + num_kv_heads) * dim].reshape(-1, dim), k_weight, eps)
    qk = torch.cat([q, k.view(rows, num_kv_heads, dim)], dim=1)
    width = cos.shape[-1]
    rotated = apply_rotary(qk[..., :width], cos[:, None], sin[:, None])
    return torch.cat([rotated, qk[..., width:]], dim=-1) if width < dim else rotated


def supports(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> bool:
    """Whether :func:`qk_norm_rotary` takes its kernel for these operands."""
    dim, width = q_weight.shape[0], cos.shape[-1]
    return (kernels.runs_kernel(qkv) and qkv.dim() == 2 and qkv.stride(1) == 1
            and qkv.dtype == q_weight.dtype == k_weight.dtype == cos.dtype == sin.dtype == torch.bfloat16
            and q_weight.is_contiguous() and k_weight.is_contiguous() and k_weight.shape == q_weight.shape
            and cos.shape == sin.shape == (qkv.shape[0], width) and cos.stride(1) == sin.stride(1) == 1
            and width % 2 == 0 and width <= dim and _pow2(width // 2) and (width == dim or _pow2(dim - width)))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def qk_norm_rotary(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                   cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The Triton kernel where :func:`supports` says so (a programmatic dependent of the q|k|v GEMM where
    :mod:`.dependent_launch` says so), else the reference. Same signature as :func:`qk_norm_rotary_ref`."""
    if not supports(qkv, q_weight, k_weight, cos, sin):
        return qk_norm_rotary_ref(qkv, q_weight, k_weight, eps, cos, sin, num_heads, num_kv_heads)
    rows, dim, width = qkv.shape[0], q_weight.shape[0], cos.shape[-1]
    heads = num_heads + num_kv_heads
    out = torch.empty(rows, heads, dim, dtype=qkv.dtype, device=qkv.device)
    if rows:
        pdl = dependent_launch.launches_dependent(qkv)
        _qk_norm_rotary_kernel[(rows, triton.cdiv(heads, BLOCK_HEADS))](
            qkv, q_weight, k_weight, cos, sin, out, num_heads, heads, qkv.stride(0), cos.stride(0), sin.stride(0),
            eps, DIM=dim, HALF=width // 2, REST=dim - width, BLOCK_REST=max(1, dim - width), BLOCK_HEADS=BLOCK_HEADS,
            PDL=pdl, num_warps=4, **dependent_launch.launch_options(pdl))
    return out


@torch.library.custom_op("tllm_spec::qk_norm_rotary", mutates_args=())
def qk_norm_rotary_op(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                      cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """:func:`qk_norm_rotary` as a torch op (opaque to torch.compile)."""
    return qk_norm_rotary(qkv, q_weight, k_weight, eps, cos, sin, num_heads, num_kv_heads)


@qk_norm_rotary_op.register_fake
def _(qkv, q_weight, k_weight, eps, cos, sin, num_heads, num_kv_heads):
    return qkv.new_empty(qkv.shape[0], num_heads + num_kv_heads, q_weight.shape[0])


if triton is not None:
    from .dependent_launch import wait_and_release
    from .rotary import _round_to_bf16 as rounded

    @triton.jit
    def _qk_norm_rotary_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, heads, stride_row,
                               stride_cm, stride_sm, eps, DIM: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr,
                               BLOCK_REST: tl.constexpr, BLOCK_HEADS: tl.constexpr, PDL: tl.constexpr):
        """Program (token, block of heads over q then k): each head's halves x1, x2 of its rotated features and
        the rest x3 (REST features, none when the whole head rotates), normalised, then x1, x2 rotated."""
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        ok = (head < heads)[:, None]
        is_q = (head < num_heads)[:, None]
        d = tl.arange(0, HALF)[None, :]
        src = qkv_ptr + row * stride_row + head[:, None] * DIM
        dst = out_ptr + row * heads * DIM + head[:, None] * DIM
        if PDL:
            wait_and_release()
        x1 = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=ok, other=0.0).to(tl.float32)
        squares = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        if REST > 0:
            r = tl.arange(0, BLOCK_REST)[None, :]
            x3 = tl.load(src + 2 * HALF + r, mask=ok & (r < REST), other=0.0).to(tl.float32)
            squares += tl.sum(x3 * x3, 1)
        rstd = tl.math.rsqrt(squares * (1.0 / DIM) + eps)[:, None]  # the mean as torch's CUDA reduction takes it
        n1 = _normed(x1, rstd, qw_ptr, kw_ptr, d, is_q)
        n2 = _normed(x2, rstd, qw_ptr, kw_ptr, HALF + d, is_q)
        table = row * stride_cm + d
        cos1 = tl.load(cos_ptr + table).to(tl.float32)
        cos2 = tl.load(cos_ptr + table + HALF).to(tl.float32)
        table = row * stride_sm + d
        sin1 = tl.load(sin_ptr + table).to(tl.float32)
        sin2 = tl.load(sin_ptr + table + HALF).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        first = rounded(rounded(n1 * cos1) - rounded(n2 * sin1))
        second = rounded(rounded(n2 * cos2) + rounded(n1 * sin2))
        tl.store(dst + d, first.to(dtype), mask=ok)  # already bf16 values: the casts are exact
        tl.store(dst + HALF + d, second.to(dtype), mask=ok)
        if REST > 0:
            n3 = _normed(x3, rstd, qw_ptr, kw_ptr, 2 * HALF + r, is_q)
            tl.store(dst + 2 * HALF + r, n3.to(dtype), mask=ok & (r < REST))

    @triton.jit
    def _normed(x, rstd, qw_ptr, kw_ptr, cols, is_q):
        """x * rstd rounded to bf16, times its head's norm weight at ``cols`` (q's or k's), rounded."""
        weight = tl.where(is_q, tl.load(qw_ptr + cols), tl.load(kw_ptr + cols)).to(tl.float32)
        return rounded(weight * rounded(x * rstd))
