"""An fp32 router's logits for a decoding step's few rows: ``x.float() @ weight.float().T``, the products and their
sums in fp32, as GLM-4.5's router computes them (its weight is kept in fp32).

cuBLAS runs that [rows, H] x [H, E] fp32 GEMM (2 MB of weight for GLM-4.5-Air's 128 experts of 4096) in 8.8 us on an
H200, far from its read. Here one program owns one expert: it streams the expert's weight row in ``BLOCK_K`` tiles
(the first loaded before it waits on the kernel in front, :mod:`.dependent_launch`, as the weight is no kernel's
result), multiplies the rows of x widened to fp32 into per-lane partial sums and adds them up at the end. The sums
are ordered differently from cuBLAS's (as every few-row GEMM of a step is): the same logits to fp32 rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
from . import dependent_launch

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

MAX_ROWS = 32  # past a draft tree's verify rows, cuBLAS's tiles reuse each weight tile over the rows
TILE = 4096  # elements of a program's [rows, BLOCK_K] partial sums (32 registers a thread at 4 warps)


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Torch reference (the CPU path and the oracle). x [M, H] (any float dtype); weight [E, H] -> logits [M, E]
    fp32: the stock router's ``F.linear(x.float(), weight.float())``."""
    return F.linear(x.float(), weight.float())


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`router_logits` takes its kernel for these operands."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    return (kernels.runs_kernel(x) and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(1) == 1
            and x.dtype in floats and weight.dtype in floats and weight.is_contiguous()
            and weight.shape[1] == x.shape[1])


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The Triton kernel where :func:`supports` says so (one program per expert), else the reference. Same
    signature as :func:`router_logits_ref`; the same logits up to the order of the fp32 sums."""
    if not supports(x, weight):
        return router_logits_ref(x, weight)
    (rows, hidden), experts = x.shape, weight.shape[0]
    out = torch.empty(rows, experts, dtype=torch.float32, device=x.device)
    padded = triton.next_power_of_2(rows)
    block_k = max(16, min(triton.next_power_of_2(hidden), TILE // padded))
    pdl = dependent_launch.launches_dependent(x)
    _router_logits_kernel[(experts,)](x, weight, out, rows, hidden, x.stride(0), ROWS=padded, BLOCK_K=block_k,
                                      PDL=pdl, num_warps=4, **dependent_launch.launch_options(pdl))
    return out


@torch.library.custom_op("tllm_spec::router_logits", mutates_args=())
def router_logits_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`router_logits` as a torch op (opaque to torch.compile)."""
    return router_logits(x, weight)


@router_logits_op.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


if triton is not None:
    from .dependent_launch import wait_and_release

    @triton.jit
    def _router_logits_kernel(x_ptr, w_ptr, out_ptr, M, K, stride_xm, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                              PDL: tl.constexpr):
        """Program e: logits[:, e] = the rows of x times weight row e over all of K, in fp32."""
        expert = tl.program_id(0)
        rows = tl.arange(0, ROWS)
        offs_k = tl.arange(0, BLOCK_K)
        w_row = w_ptr + expert.to(tl.int64) * K
        x_rows = x_ptr + rows[:, None] * stride_xm
        mask_m = rows < M
        w = tl.load(w_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)  # a weight, not a kernel's result
        if PDL:
            wait_and_release()
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        acc = x.to(tl.float32) * w[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            ks = k0 + offs_k
            w = tl.load(w_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & (ks < K)[None, :], other=0.0)
            acc += x.to(tl.float32) * w[None, :]
        tl.store(out_ptr + rows * (tl.num_programs(0)) + expert, tl.sum(acc, axis=1), mask=mask_m)
