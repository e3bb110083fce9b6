"""``y = x @ weight.T (+ bias)`` for the few rows a decoding step has (M <= 16): a weight-streaming GEMM.

A decoding step's projections read megabytes of weight for a handful of token rows, so their speed is the
weight read. One program owns ``BLOCK_N`` output features over the whole of K (no split-K, so no second
reduction kernel) and streams its weight tiles through Triton's software pipeline (``num_stages``); the token
rows are padded to 16 inside the kernel for the tensor-core dot. bf16/fp16 only: fp32 keeps cuBLAS (and its
exact rounding). :func:`skinny_linear_op` is the torch custom op the fused layers call: it takes the kernel
where :func:`supports` says so and cuBLAS otherwise, per call, so one compiled graph serves both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

MAX_ROWS = 16


def tile_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [n, k] weight, from ``scripts/bench_skinny_linear.py``
    on an H200 (Llama-3.1-8B shapes, 1 and 4 rows): few output features (o, down, the EAGLE-3 fc) want long K
    tiles, many (gate/up, lm_heads) short ones."""
    if n <= 4096:
        return 32, 512, 4, 4
    if n >= 16384:
        return 64, 128, 4, 3
    return 64, 256, 4, 4


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Torch reference (the CPU path and the oracle). x [M, K]; weight [N, K]; bias [N] -> [M, N]."""
    return F.linear(x, weight, bias)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`skinny_linear` takes its kernel for these operands."""
    return (kernels.runs_kernel(x) and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and weight.is_contiguous() and x.stride(1) == 1
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The Triton kernel where :func:`supports` says so, else the reference. Same signature as
    :func:`skinny_linear_ref`; ``config`` = (BLOCK_N, BLOCK_K, num_warps, num_stages), default
    :func:`tile_config`."""
    if not supports(x, weight, bias):
        return skinny_linear_ref(x, weight, bias)
    rows, k = x.shape
    n = weight.shape[0]
    block_n, block_k, num_warps, num_stages = config or tile_config(n, k)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _skinny_linear_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, rows, n, k, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, ROWS=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        num_stages=num_stages)
    return out


@torch.library.custom_op("tllm_spec::skinny_linear", mutates_args=())
def skinny_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`skinny_linear` as a torch op (opaque to torch.compile). x [..., K] -> [..., N]."""
    return skinny_linear(x, weight, bias)


@skinny_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


if triton is not None:

    @triton.jit
    def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym, HAS_BIAS: tl.constexpr,
                              ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One program: output features [pid * BLOCK_N, +BLOCK_N) for all M (<= ROWS) rows, the whole of K."""
        pid = tl.program_id(0)
        offs_m = tl.arange(0, ROWS)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m, mask_n = offs_m < M, offs_n < N
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            mask_k = ks < K
            w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])
