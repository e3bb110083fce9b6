"""``y = x @ weight.T (+ bias)`` for the few rows a decoding step has (M <= 32: a chain's or a draft tree's): a
weight-streaming GEMM, optionally with the SwiGLU product of a fused gate/up projection, or a residual add, as its
epilogue.

A decoding step's projections read megabytes of weight for a handful of token rows, so their speed is the
weight read. One program owns ``BLOCK_N`` output features over the whole of K (no split-K, so no second
reduction kernel) and streams its weight tiles through Triton's software pipeline (``num_stages``); the token
rows are padded to 16 (or 32, :func:`padded_rows`) inside the kernel for the tensor-core dot. bf16/fp16 only:
fp32 keeps cuBLAS (and its exact rounding). :func:`skinny_linear_op` is the torch custom op the fused layers call:
it takes the kernel where :func:`supports` says so and cuBLAS otherwise, per call, so one compiled graph serves
both.

``gated``: weight is gate | up stacked ([2I, K]) and the result ``silu(gate) * up`` [M, I]. Each program
loads its gate rows and the matching up rows interleaved, so the product is its epilogue: no activation
kernel, and the [M, 2I] projection never reaches memory. ``residual``: the rounded result plus a residual
[M, N], rounded again (eager torch's ``residual + y``). ``rope_cos``/``rope_sin`` [M, D] with
``rotary_cols``: the first ``rotary_cols`` output features (a fused q|k|v projection's q and k heads) are
rotated (RoPE) in the epilogue, the first D features of each head of ``head_dim`` (D by default; GLM-4.5's partial
rotary embedding rotates half of each head): a program over them loads each rotary pair's weight rows (d, d + D/2)
side by side, as the gated case loads gate and up, so no rotary kernel runs between the projection and attention.
(Folding an RMSNorm in front instead was measured and
dropped: its sums of squares and the elementwise work on the x tile inside the K loop cost the GEMM more than
the norm's own kernel.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
from ..model.rotary import apply_rotary
from . import dependent_launch
from .silu_mul import silu_mul_ref

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

MAX_ROWS = 32  # a verify step of one request's draft tree (26 tokens by default) still streams its weights


def padded_rows(rows: int) -> int:
    """The kernel's row tile: 16 for a chain's few rows (the tile it was tuned with), 32 up to MAX_ROWS."""
    return 16 if rows <= 16 else 32


def tile_config(n: int, k: int, rows: int = 1) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [n, k] weight, from ``scripts/bench_skinny_linear.py``
    on an H200 (Llama-3.1-8B shapes, 1 and 4 rows): few output features (o, down, the EAGLE-3 fc) want long K
    tiles, many (gate/up, lm_heads) short ones. The 32-row tile (17 to 32 rows), swept on an H200 at 32 rows
    (`docs/benchmarks/h200-trees/skinny32.json`), keeps the many-feature tiles; with few features it reads K in
    256-wide tiles six stages deep (down 3641 GB/s, where the 512-wide tile it had, three stages deep, read 3381
    and four deep 3525). The mixture-of-experts shapes (``--shape qwen3-30b-a3b``, 1 and 4 rows) have few SMs' worth
    of features: up to 2048 features (o, the router) take 16-wide programs (o 2035 -> 2181 GB/s, the router 121
    -> 138, where cuBLAS reads 99), and q|k|v over K = 2048 short K tiles six deep (2382 -> 2551)."""
    few = padded_rows(rows) == 16
    if n <= 4096:
        return ((16 if n <= 2048 else 32), 512, 4, 4) if few else (32, 256, 4, 6)
    if n >= 16384:
        return 64, 128, 4, 3
    return (64, 128, 4, 6) if few and k <= 2048 else (64, 256, 4, 4)


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      config: tuple[int, int, int, int] | None = None, gated: bool = False,
                      residual: torch.Tensor | None = None, rope_cos: torch.Tensor | None = None,
                      rope_sin: torch.Tensor | None = None, rotary_cols: int = 0, head_dim: int = 0) -> torch.Tensor:
    """Torch reference (the CPU path and the oracle). x [M, K]; weight [N, K]; bias [N] -> y [M, N]; ``gated``:
    -> ``silu(y[:, :N/2]) * y[:, N/2:]`` [M, N/2], the stock SwiGLU's ops and roundings; ``residual`` (the
    result's shape): ``residual + result``; ``rope_cos``, ``rope_sin`` [M, D]: y[:, :rotary_cols] rotated per
    head (:func:`rotate_columns_ref`)."""
    y = F.linear(x, weight, bias)
    if gated:
        y = silu_mul_ref(y)
    if rope_cos is not None:
        y = rotate_columns_ref(y, rope_cos, rope_sin, rotary_cols, head_dim)
    return y if residual is None else residual + y


def rotate_columns_ref(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_cols: int,
                       head_dim: int = 0) -> torch.Tensor:
    """y [M, F] with its first ``rotary_cols`` features (a q|k|v projection's q and k heads of ``head_dim``, default
    D) rotated, the first D features of each head (cos, sin [M, D]) by the stock ``apply_rotary``, the rest as they
    are: the rotary epilogue's reference."""
    width = cos.shape[-1]
    heads = y[:, :rotary_cols].view(y.shape[0], -1, head_dim or width)
    rotated = apply_rotary(heads[..., :width], cos[:, None], sin[:, None])
    if width < heads.shape[-1]:  # a partial rotary embedding: the rest of each head passes
        rotated = torch.cat([rotated, heads[..., width:]], dim=-1)
    return torch.cat([rotated.flatten(1), y[:, rotary_cols:]], dim=1)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
             residual: torch.Tensor | None = None, rope_cos: torch.Tensor | None = None,
             rope_sin: torch.Tensor | None = None, rotary_cols: int = 0,
             config: tuple[int, int, int, int] | None = None, head_dim: int = 0) -> bool:
    """Whether :func:`skinny_linear` takes its kernel for these operands."""
    out_features = weight.shape[0] // 2 if gated else weight.shape[0]
    return (kernels.runs_kernel(x) and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and weight.is_contiguous() and x.stride(1) == 1
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
            and (not gated or weight.shape[0] % 2 == 0)
            and (residual is None or (residual.dtype == x.dtype and residual.shape == (x.shape[0], out_features)
                                      and residual.stride(1) == 1))
            and (rope_cos is None or rotary_fits(x.shape[0], weight.shape[0], x.dtype, gated, rope_cos, rope_sin,
                                                 rotary_cols, (config or tile_config(*weight.shape, x.shape[0]))[0],
                                                head_dim)))


def rotary_fits(rows: int, n: int, dtype: torch.dtype, gated: bool, cos: torch.Tensor, sin: torch.Tensor,
                rotary_cols: int, block_n: int, head_dim: int = 0) -> bool:
    """Whether a GEMM kernel's rotary epilogue takes these operands (``rows`` x ``n`` results in ``dtype``, programs
    of ``block_n`` features, heads of ``head_dim``, default the table's width): a program's BLOCK_N / 2 rotary pairs
    lie in one head's rotated features, and its columns are all rotated or none."""
    width = cos.shape[-1]
    head = head_dim or width
    return (not gated and cos.shape == sin.shape == (rows, width) and cos.dtype == sin.dtype == dtype
            and cos.stride(1) == sin.stride(1) == 1 and width % block_n == 0 and head % block_n == 0
            and width <= head and rotary_cols % head == 0 and rotary_cols <= n)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None, gated: bool = False,
                  residual: torch.Tensor | None = None, rope_cos: torch.Tensor | None = None,
                  rope_sin: torch.Tensor | None = None, rotary_cols: int = 0, head_dim: int = 0) -> torch.Tensor:
    """The Triton kernel where :func:`supports` says so, else the reference. Same signature as
    :func:`skinny_linear_ref`; ``config`` = (BLOCK_N, BLOCK_K, num_warps, num_stages), default
    :func:`tile_config` (BLOCK_N counts gate and up rows together)."""
    if not supports(x, weight, bias, gated, residual, rope_cos, rope_sin, rotary_cols, config, head_dim):
        return skinny_linear_ref(x, weight, bias, gated=gated, residual=residual, rope_cos=rope_cos,
                                 rope_sin=rope_sin, rotary_cols=rotary_cols, head_dim=head_dim)
    rows, k = x.shape
    n = weight.shape[0]
    block_n, block_k, num_warps, num_stages = config or tile_config(n, k, rows)
    out = torch.empty(rows, n // 2 if gated else n, dtype=x.dtype, device=x.device)
    rotary = rope_cos is not None
    pdl = dependent_launch.launches_dependent(x)
    _skinny_linear_kernel[(triton.cdiv(out.shape[1], block_n // 2 if gated else block_n),)](
        x, weight, bias if bias is not None else weight, residual if residual is not None else out, out,
        rope_cos if rotary else out, rope_sin if rotary else out, rows, out.shape[1], k, x.stride(0),
        out.stride(0), 0 if residual is None else residual.stride(0), rope_cos.stride(0) if rotary else 0,
        rope_sin.stride(0) if rotary else 0, rotary_cols if rotary else 0,
        HAS_BIAS=bias is not None, GATED=gated, HAS_RESIDUAL=residual is not None, ROTARY=rotary,
        HALF_HEAD=rope_cos.shape[-1] // 2 if rotary else 1, HEAD=(head_dim or rope_cos.shape[-1]) if rotary else 2,
        ROWS=padded_rows(rows), BLOCK_N=block_n,
        BLOCK_K=block_k, PDL=pdl, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
        **dependent_launch.launch_options(pdl))
    return out


@torch.library.custom_op("tllm_spec::skinny_linear", mutates_args=())
def skinny_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False,
                     residual: torch.Tensor | None = None, rope_cos: torch.Tensor | None = None,
                     rope_sin: torch.Tensor | None = None, rotary_cols: int = 0, head_dim: int = 0) -> torch.Tensor:
    """:func:`skinny_linear` as a torch op (opaque to torch.compile). x [..., K] -> [..., N] (gated: N/2)."""
    return skinny_linear(x, weight, bias, gated=gated, residual=residual, rope_cos=rope_cos, rope_sin=rope_sin,
                         rotary_cols=rotary_cols, head_dim=head_dim)


@skinny_linear_op.register_fake
def _(x, weight, bias, gated=False, residual=None, rope_cos=None, rope_sin=None, rotary_cols=0, head_dim=0):
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2 if gated else weight.shape[0], dtype=dtype)


if triton is not None:
    from .dependent_launch import wait_and_release

    @triton.jit
    def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, cos_ptr, sin_ptr, M, N, K, stride_xm, stride_ym,
                              stride_rm, stride_cm, stride_sm, rotary_cols, HAS_BIAS: tl.constexpr,
                              GATED: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROTARY: tl.constexpr,
                              HALF_HEAD: tl.constexpr, HEAD: tl.constexpr, ROWS: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """One program: output features [pid * BLOCK_N, +BLOCK_N) for all M (<= ROWS) rows, the whole of K.
        GATED: N is the output width I; the program's BLOCK_N weight rows are gate row f and up row I + f
        interleaved for its BLOCK_N / 2 features f, and it stores silu(gate) * up (each rounded as eager
        torch rounds them). ROTARY: a program below ``rotary_cols`` in the first 2 * HALF_HEAD features of a head
        of HEAD takes the rows d and d + HALF_HEAD of its head interleaved and stores them rotated
        (x * cos + rotate_half(x) * sin, eager's roundings).
        HAS_RESIDUAL: plus r, rounded again. PDL: launched as a programmatic dependent of the previous kernel
        (:mod:`.dependent_launch`). (Asking L2 for the first weight tiles before the wait was measured on an
        H200 and dropped: 32 KB a program gained 0.01 ms a step, 64 KB and more lost up to 0.24 ms.)"""
        pid = tl.program_id(0)
        offs_m = tl.arange(0, ROWS)
        offs_k = tl.arange(0, BLOCK_K)
        w_row, mask_n = weight_rows(pid, N, rotary_cols, GATED, ROTARY, HALF_HEAD, HEAD, BLOCK_N)
        mask_m = offs_m < M
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        w_rows = w_ptr + w_row[:, None].to(tl.int64) * K
        if PDL:
            wait_and_release()
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            mask_k = ks < K
            w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + w_row, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        y, offs_n = finish_rows(acc, y_ptr.dtype.element_ty, pid, w_row, offs_m, mask_m, cos_ptr, sin_ptr, stride_cm,
                                stride_sm, rotary_cols, GATED, ROTARY, HALF_HEAD, HEAD, ROWS, BLOCK_N)
        store_rows(y, y_ptr, r_ptr, offs_m, offs_n, mask_m, N, stride_ym, stride_rm, HAS_RESIDUAL)

    @triton.jit
    def rotated_program(pid, rotary_cols, HALF_HEAD: tl.constexpr, HEAD: tl.constexpr, BLOCK_N: tl.constexpr):
        """Whether program ``pid``'s BLOCK_N columns are rotary features: below ``rotary_cols``, in the first
        2 * HALF_HEAD features of their head of HEAD."""
        first = pid * BLOCK_N
        return (first < rotary_cols) & (first % HEAD < 2 * HALF_HEAD)

    @triton.jit
    def rotary_pairs(pid, HEAD: tl.constexpr, BLOCK_N: tl.constexpr):
        """A rotated program's BLOCK_N / 2 rotary pairs d (rows d and d + HALF_HEAD of its head)."""
        return (pid * BLOCK_N % HEAD) // 2 + tl.arange(0, BLOCK_N // 2)

    @triton.jit
    def weight_rows(pid, N, rotary_cols, GATED: tl.constexpr, ROTARY: tl.constexpr, HALF_HEAD: tl.constexpr,
                    HEAD: tl.constexpr, BLOCK_N: tl.constexpr):
        """(the weight rows of output-feature program ``pid``'s BLOCK_N columns, which of them exist): GATED, gate
        row f and up row N + f interleaved for its BLOCK_N / 2 features f; ROTARY, a :func:`rotated_program`'s rows
        d and d + HALF_HEAD of one head interleaved (the pairs the epilogue rotates); else the program's rows."""
        cols = tl.arange(0, BLOCK_N)
        if GATED:
            pair = pid * (BLOCK_N // 2) + cols // 2  # the program's feature of each weight row
            w_row = pair + (cols % 2) * N  # gate, up, gate, up, ...
            mask_n = pair < N
        else:
            w_row = pid * BLOCK_N + cols
            if ROTARY:
                if rotated_program(pid, rotary_cols, HALF_HEAD, HEAD, BLOCK_N):  # d, d + D/2, d + 1, d + 1 + D/2, ...
                    d = (pid * BLOCK_N % HEAD) // 2 + cols // 2  # each column's pair (rotary_pairs)
                    w_row = (pid * BLOCK_N // HEAD) * HEAD + d + (cols % 2) * HALF_HEAD
            mask_n = w_row < N
        return w_row, mask_n

    @triton.jit
    def finish_rows(acc, dtype, pid, w_row, offs_m, mask_m, cos_ptr, sin_ptr, stride_cm, stride_sm, rotary_cols,
                    GATED: tl.constexpr, ROTARY: tl.constexpr, HALF_HEAD: tl.constexpr, HEAD: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        """(the results in ``dtype`` of fp32 sums acc [ROWS, BLOCK_N] over :func:`weight_rows`' rows, their output
        columns): GATED, the SwiGLU products; ROTARY, a rotated program's pairs rotated; else acc rounded."""
        if GATED:
            y = swiglu_pairs(acc, dtype, ROWS, BLOCK_N)
            offs_n = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        else:
            y = acc.to(dtype)
            offs_n = w_row
            if ROTARY:
                if rotated_program(pid, rotary_cols, HALF_HEAD, HEAD, BLOCK_N):
                    y = _rotate_pairs(y, cos_ptr, sin_ptr, stride_cm, stride_sm, offs_m, mask_m,
                                      rotary_pairs(pid, HEAD, BLOCK_N), HALF_HEAD, ROWS, BLOCK_N)
        return y, offs_n

    @triton.jit
    def swiglu_pairs(acc, dtype, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        """acc [ROWS, BLOCK_N] of gate, up, gate, up, ... columns -> silu(gate) * up [ROWS, BLOCK_N / 2] in
        ``dtype``, each step rounded as eager torch rounds it."""
        gate, up = tl.split(tl.reshape(acc.to(dtype).to(tl.float32), (ROWS, BLOCK_N // 2, 2)))
        return ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up).to(dtype)

    @triton.jit
    def store_rows(y, y_ptr, r_ptr, offs_m, offs_n, mask_m, N, stride_ym, stride_rm, HAS_RESIDUAL: tl.constexpr):
        """Store y [rows, cols] at (offs_m, offs_n) of y_ptr (columns below N), plus the residual's same entries
        first when HAS_RESIDUAL (rounded again, as eager torch's ``residual + y``)."""
        mask_y = mask_m[:, None] & (offs_n < N)[None, :]
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask_y, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(y.dtype)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=mask_y)

    @triton.jit
    def _rotate_pairs(y, cos_ptr, sin_ptr, stride_cm, stride_sm, offs_m, mask_m, pairs, HALF_HEAD: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        """y [ROWS, BLOCK_N]: columns (a, b) = rows (d, d + D/2) of a head, interleaved -> the same columns
        rotated: (a cos - b sin, b cos + a sin), each product and sum rounded to y's dtype as in eager torch."""
        dtype = y.dtype
        a, b = tl.split(tl.reshape(y.to(tl.float32), (ROWS, BLOCK_N // 2, 2)))
        d = (pairs % HALF_HEAD)[None, :]
        m = offs_m[:, None]
        mask = mask_m[:, None]
        cos_a = tl.load(cos_ptr + m * stride_cm + d, mask=mask, other=0.0).to(tl.float32)
        sin_a = tl.load(sin_ptr + m * stride_sm + d, mask=mask, other=0.0).to(tl.float32)
        cos_b = tl.load(cos_ptr + m * stride_cm + d + HALF_HEAD, mask=mask, other=0.0).to(tl.float32)
        sin_b = tl.load(sin_ptr + m * stride_sm + d + HALF_HEAD, mask=mask, other=0.0).to(tl.float32)
        new_a = ((a * cos_a).to(dtype).to(tl.float32) - (b * sin_a).to(dtype).to(tl.float32)).to(dtype)
        new_b = ((b * cos_b).to(dtype).to(tl.float32) + (a * sin_b).to(dtype).to(tl.float32)).to(dtype)
        return tl.reshape(tl.join(new_a, new_b), (ROWS, BLOCK_N))
