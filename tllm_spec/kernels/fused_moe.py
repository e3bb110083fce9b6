"""The experts of a mixture-of-experts layer (Qwen3-MoE, GLM-4.5, Mixtral): each token's k routed SwiGLU experts,
weighted by the router and summed, with no host synchronisation, so a step with MoE layers stays one CUDA graph.

Scheme: the P = N * k (token, expert) pairs p = n * k + j are sorted by expert and each expert's group is padded
to a multiple of ``block_m`` (:func:`~.moe_align.moe_align`, two launches), so every block of ``block_m`` sorted pairs
belongs to one expert. Two grouped GEMMs run over those blocks on static grids (sized by the bound ``max_padded``,
not by the step's counts; a block past the step's padded count has no expert and returns at once): gate|up with the
SwiGLU product as its epilogue -> [P, I], then down with the pair's routing weight as its epilogue -> [P, H] fp32;
a torch sum over each token's k pairs finishes. A one-token step's k pairs take the direct blocks instead
(``MoeTiles.direct``): one pair per block, its expert read from the router's ids, no alignment launch at all; a
pair's row comes out the same either way (a row's dot products do not depend on the block's other rows), but
direct blocks read an expert once per pair that chose it, so only distinct experts (one token's) go direct.

Rounding is the stock expert loop's: the gate/up product, silu and the SwiGLU product, and the down product each
rounded to x's dtype; then scaled by the fp32 routing weight and summed over the k experts in fp32, rounded once.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import kernels
from . import dependent_launch
from .moe_align import moe_align

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

class MoeTiles(NamedTuple):
    """``block_m``: sorted pairs per block (both GEMMs and the alignment); per GEMM (BLOCK_N, BLOCK_K, num_warps,
    num_stages); gate_up's BLOCK_N counts gate columns (the program computes as many up columns beside them);
    ``direct``: one block per pair, unaligned (block_m then only pads the dot's rows)."""
    block_m: int
    gate_up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]
    direct: bool = False


def tile_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype
                ) -> MoeTiles:
    """Tiles from host-known shapes, swept on an H200 (``scripts/bench_fused_moe.py``, Qwen3-30B-A3B, GLM-4.5-Air at
    TP 2 and Mixtral expert shapes, 1 to 256 rows): blocks of 16 pairs (the tensor-core dot's rows) while a block
    averages few pairs of its expert; gate|up in 32-column programs, which fill the SMs at a few experts (Qwen3 at
    one row: 31.8 -> 24.6 us with the direct blocks), with 256-wide K tiles five deep for wide experts (Mixtral);
    down in 64 columns. The direct blocks (no alignment launch, an expert read once per pair) for one token, whose
    k experts are distinct: that saves the 6 us alignment. More tokens align, as the rows of a verify step share
    experts: at 4 rows of the 30B-A3B shape a step read 9.1 distinct experts a layer for its 32 pairs, and direct
    blocks, which read each pair's expert, made the EAGLE-3 step 5.24 ms (4.83 with last version's aligned tiles),
    though on random routings they had won (78.1 -> 71.4 us at 4 rows). Prompt chunks (more pairs per expert) keep
    first guesses: taller blocks reuse each weight tile over more rows. fp32
    tiles take twice the shared memory: half as wide in K."""
    k_scale, num_pairs = 2 if dtype == torch.float32 else 1, num_tokens * top_k
    per_expert = num_pairs / num_experts
    block_m = 16 if num_pairs <= 128 or per_expert <= 16 else 32 if per_expert <= 64 else 64
    if block_m == 16:
        gate_up = (32, 256, 4, 5) if inter >= 8192 else (32, 128, 4, 4)
        down = (64, 128, 4, 4) if num_pairs <= 128 else (64, 128, 4, 3)
    else:
        warps = 8 if block_m == 64 else 4
        gate_up, down = (64, 64, warps, 3), (128, 64, warps, 3)
    return MoeTiles(block_m, _fit(gate_up, inter, hidden, k_scale), _fit(down, hidden, inter, k_scale),
                    direct=num_tokens == 1)


def _fit(tile: tuple[int, int, int, int], n: int, k: int, k_scale: int) -> tuple[int, int, int, int]:
    """No wider than the (power-of-two rounded) sizes, no narrower than the dot's 16."""
    block_n, block_k, warps, stages = tile
    return (max(16, min(block_n, triton.next_power_of_2(n))),
            max(16, min(block_k // k_scale, triton.next_power_of_2(k))), warps, stages)


def fused_moe_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, reduce: bool = True, tiles: MoeTiles | None = None) -> torch.Tensor:
    """Torch reference (the CPU path and the oracle): a loop over the experts hit (a host sync). x [N, H];
    gate_up [E, 2I, H] (gate rows first); down [E, H, I]; topk_weights [N, k] fp32; topk_ids [N, k] int32/int64
    -> [N, H] in x.dtype; ``reduce=False``: each pair's weighted product [N, k, H] in fp32 instead, whose sum over
    k (then the cast) is the result, for a caller that fuses the sum with what follows. Ids outside [0, E)
    contribute nothing. ``tiles`` (the kernels' override of :func:`tile_config`) changes nothing here."""
    num_tokens, top_k = topk_ids.shape
    flat_ids, flat_weights = topk_ids.flatten(), topk_weights.flatten().float()
    out = torch.zeros(num_tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    for expert in flat_ids.unique().tolist():
        if not 0 <= expert < gate_up.shape[0]:
            continue
        pairs = (flat_ids == expert).nonzero().squeeze(1)
        gate, up = F.linear(x[pairs // top_k], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out[pairs] = y.float() * flat_weights[pairs, None]
    out = out.view(num_tokens, top_k, x.shape[1])
    return out.sum(1).to(x.dtype) if reduce else out


def supports(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor) -> bool:
    """Whether :func:`fused_moe` takes its kernels for these operands."""
    return (kernels.runs_kernel(x) and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.dim() == 2
            and x.stride(1) == 1 and gate_up.dtype == down.dtype == x.dtype and gate_up.is_contiguous()
            and down.is_contiguous() and topk_ids.dtype in (torch.int32, torch.int64) and topk_ids.dim() == 2
            and topk_ids.is_contiguous() and topk_weights.shape == topk_ids.shape
            and topk_weights.dtype == torch.float32 and topk_weights.is_contiguous())


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, reduce: bool = True, tiles: MoeTiles | None = None) -> torch.Tensor:
    """The Triton kernels where :func:`supports` says so, else the reference. Same signature as
    :func:`fused_moe_ref`, except that ids must lie in [0, E) here (a router's top-k does): a pair of another id
    is never computed on aligned blocks and its row of the sum is garbage, and direct blocks (one token) would read
    past the experts for an id of E or more."""
    if not supports(x, gate_up, down, topk_weights, topk_ids):
        return fused_moe_ref(x, gate_up, down, topk_weights, topk_ids, reduce, tiles)
    (num_tokens, hidden), (num_experts, _, inter), top_k = x.shape, down.shape, topk_ids.shape[1]
    assert gate_up.shape == (num_experts, 2 * inter, hidden) and down.shape[1] == hidden, (gate_up.shape, down.shape)
    assert topk_ids.shape[0] == num_tokens, (topk_ids.shape, x.shape)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return x.new_zeros(num_tokens, hidden) if reduce else x.new_zeros(num_tokens, top_k, hidden,
                                                                          dtype=torch.float32)
    tiles = tiles or tile_config(num_tokens, top_k, num_experts, hidden, inter, x.dtype)
    if tiles.direct:  # block p is pair p, of expert topk_ids[p] (no sorted order: the ids stand in for it)
        blocks, num_blocks = (topk_ids, topk_ids, num_pairs), num_pairs
    else:
        sorted_pair_ids, block_expert, _ = moe_align(topk_ids, num_experts, tiles.block_m)
        blocks, num_blocks = (sorted_pair_ids, block_expert, num_pairs), block_expert.shape[0]
    pdl = dependent_launch.launches_dependent(x)
    flags = {"FP32": x.dtype == torch.float32, "CUDA": x.is_cuda, "DIRECT": tiles.direct, "PDL": pdl,
             **dependent_launch.launch_options(pdl)}
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [P, I]: silu(gate) * up per pair
    block_n, block_k, num_warps, num_stages = tiles.gate_up
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, gate_up, h, *blocks, top_k, hidden, inter, x.stride(0), BLOCK_M=tiles.block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, **flags, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False)
    # fp32: the weighted products are summed in fp32 (the rounding once at the end that the reference has)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    block_n, block_k, num_warps, num_stages = tiles.down
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, down, topk_weights, y, *blocks, hidden, inter, BLOCK_M=tiles.block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, **flags, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False)
    y = y.view(num_tokens, top_k, hidden)
    return y.sum(1).to(x.dtype) if reduce else y


@torch.library.custom_op("tllm_spec::fused_moe", mutates_args=())
def fused_moe_op(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
    """:func:`fused_moe` as a torch op (opaque to torch.compile). x [N, H] -> [N, H]."""
    return fused_moe(x, gate_up, down, topk_weights, topk_ids, reduce)


@fused_moe_op.register_fake
def _(x, gate_up, down, topk_weights, topk_ids, reduce=True):
    return x.new_empty(x.shape) if reduce else x.new_empty(*topk_ids.shape, x.shape[1], dtype=torch.float32)


if triton is not None:
    from .dependent_launch import wait_and_release

    @triton.jit
    def _dot(a, b, acc, FP32: tl.constexpr, CUDA: tl.constexpr):
        """acc + a @ b in fp32: exact fp32 products for fp32 inputs. Triton's CPU interpreter has no bf16 dot, so
        there the 16-bit tiles are widened first (their products are exact in fp32 either way)."""
        if CUDA and not FP32:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return acc

    @triton.jit
    def _rounded(v, dtype: tl.constexpr, CUDA: tl.constexpr):
        """fp32 v rounded to dtype, as fp32. Triton's CPU interpreter casts to bf16 by truncation: there the
        rounding (to nearest, ties to even) is bit arithmetic."""
        if CUDA or dtype != tl.bfloat16:
            v = v.to(dtype).to(tl.float32)
        else:
            bits = v.to(tl.uint32, bitcast=True)
            v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        return v

    @triton.jit
    def _block_pairs(sorted_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
        """Block pid_m's BLOCK_M pairs, the sentinel P as padding: its slice of the sorted order, or (DIRECT) pair
        pid_m alone."""
        rows = tl.arange(0, BLOCK_M)
        if DIRECT:
            pairs = tl.where(rows == 0, pid_m, num_pairs)
        else:
            pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + rows)
        return pairs

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, h_ptr, sorted_ptr, block_expert_ptr, num_pairs, top_k, hidden, inter,
                        stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        FP32: tl.constexpr, CUDA: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr):
        """Program (block of sorted pairs m, columns n): the tokens' rows of x times expert e's gate rows n and up
        rows I + n over all of H, two accumulators; stores silu(gate) * up for its pairs, rounded as the stock
        ops round (each product, silu, the SwiGLU product to x's dtype; CUDA's expf and an IEEE division). PDL: a
        programmatic dependent (:mod:`.dependent_launch`) of the kernel that wrote the blocks' experts."""
        pid_m = tl.program_id(0)
        if PDL:
            wait_and_release()
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int32)  # -1: a block past the step's padded count
        if expert < 0:
            return
        pairs = _block_pairs(sorted_ptr, pid_m, num_pairs, BLOCK_M, DIRECT)
        mask_m = pairs < num_pairs  # the rest is padding (the sentinel P)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = cols < inter
        offs_k = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + (pairs // top_k).to(tl.int64)[:, None] * stride_xm
        gate_cols = w_ptr + expert.to(tl.int64) * 2 * inter * hidden + cols.to(tl.int64)[None, :] * hidden
        up_cols = gate_cols + inter * hidden
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + offs_k
            mask_k = ks < hidden
            a = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            mask_w = mask_k[:, None] & mask_n[None, :]
            acc_gate = _dot(a, tl.load(gate_cols + ks[:, None], mask=mask_w, other=0.0), acc_gate, FP32, CUDA)
            acc_up = _dot(a, tl.load(up_cols + ks[:, None], mask=mask_w, other=0.0), acc_up, FP32, CUDA)
        dtype = h_ptr.dtype.element_ty
        gate = _rounded(acc_gate, dtype, CUDA)
        up = _rounded(acc_up, dtype, CUDA)
        if CUDA:  # as torch's kernel computes silu
            act = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate))
        else:  # Triton's CPU interpreter has neither
            act = gate / (1.0 + tl.exp(-gate))
        h = _rounded(_rounded(act, dtype, CUDA) * up, dtype, CUDA).to(dtype)  # already in dtype: an exact cast
        tl.store(h_ptr + pairs.to(tl.int64)[:, None] * inter + cols[None, :], h,
                 mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _down_kernel(h_ptr, w_ptr, weights_ptr, y_ptr, sorted_ptr, block_expert_ptr, num_pairs, hidden, inter,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr,
                     CUDA: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr):
        """Program (block of sorted pairs m, columns n): the pairs' SwiGLU rows times expert e's down rows n over
        all of I, rounded to x's dtype, times the pair's fp32 routing weight; stored in fp32. PDL: a programmatic
        dependent of the gate|up kernel."""
        pid_m = tl.program_id(0)
        if PDL:
            wait_and_release()
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int32)  # -1: a block past the step's padded count
        if expert < 0:
            return
        pairs = _block_pairs(sorted_ptr, pid_m, num_pairs, BLOCK_M, DIRECT)
        mask_m = pairs < num_pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = cols < hidden
        offs_k = tl.arange(0, BLOCK_K)
        h_rows = h_ptr + pairs.to(tl.int64)[:, None] * inter
        w_cols = w_ptr + expert.to(tl.int64) * hidden * inter + cols.to(tl.int64)[None, :] * inter
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + offs_k
            mask_k = ks < inter
            a = tl.load(h_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_cols + ks[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc = _dot(a, w, acc, FP32, CUDA)
        weight = tl.load(weights_ptr + pairs, mask=mask_m, other=0.0)
        y = _rounded(acc, h_ptr.dtype.element_ty, CUDA) * weight[:, None]
        tl.store(y_ptr + pairs.to(tl.int64)[:, None] * hidden + cols[None, :], y,
                 mask=mask_m[:, None] & mask_n[None, :])
