"""The experts of a mixture-of-experts layer (Qwen3-MoE, GLM-4.5, Mixtral): each token's k routed SwiGLU experts,
weighted by the router and summed, with no host synchronisation, so a step with MoE layers stays one CUDA graph.

Scheme: the P = N * k (token, expert) pairs p = n * k + j are sorted by expert and each expert's group is padded
to a multiple of ``block_m`` (:func:`moe_align`, one launch), so every block of ``block_m`` sorted pairs belongs
to one expert. Two grouped GEMMs run over those blocks on static grids (sized by the bound ``max_padded``, not by
the step's counts; a program past the step's padded count returns at once): gate|up with the SwiGLU product as
its epilogue -> [P, I], then down with the pair's routing weight as its epilogue -> [P, H] fp32; a torch sum over
each token's k pairs finishes.

Rounding is the stock expert loop's: the gate/up product, silu and the SwiGLU product, and the down product each
rounded to x's dtype; then scaled by the fp32 routing weight and summed over the k experts in fp32, rounded once.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import kernels

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

# moe_align's one program walks the pairs in tiles of [pairs, experts] comparisons: past these it would take longer
# than the torch reference's two dozen small launches (a guess until measured), so prompt chunks take the reference
MAX_ALIGN_PAIRS = 4096
MAX_ALIGN_EXPERTS = 1024
ALIGN_TILE = 8192  # elements of the align kernel's [pairs, experts] comparison tile


class MoeTiles(NamedTuple):
    """``block_m``: sorted pairs per block (both GEMMs and the alignment); per GEMM (BLOCK_N, BLOCK_K, num_warps,
    num_stages); gate_up's BLOCK_N counts gate columns (the program computes as many up columns beside them)."""
    block_m: int
    gate_up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]


def tile_config(num_pairs: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> MoeTiles:
    """Tiles from host-known shapes. First guesses, to be swept on an H100/H200: a decoding step (P <= 128) hits
    about one pair per expert, so it takes the 16-row tile the tensor-core dot needs and is a weight read: wide K
    tiles, a deep pipeline. Prompt chunks hold P / E pairs per expert on average: taller tiles reuse each weight
    tile over more rows. fp32 tiles take twice the shared memory: half as wide in K."""
    k_scale = 2 if dtype == torch.float32 else 1
    if num_pairs <= 128:
        block_m, gate_up, down = 16, (64, 128, 4, 4), (64, 128, 4, 4)
    else:
        per_expert = num_pairs / num_experts
        block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
        warps = 8 if block_m == 64 else 4
        gate_up, down = (64, 64, warps, 3), (128, 64, warps, 3)
    return MoeTiles(block_m, _fit(gate_up, inter, hidden, k_scale), _fit(down, hidden, inter, k_scale))


def _fit(tile: tuple[int, int, int, int], n: int, k: int, k_scale: int) -> tuple[int, int, int, int]:
    """No wider than the (power-of-two rounded) sizes, no narrower than the dot's 16."""
    block_n, block_k, warps, stages = tile
    return (max(16, min(block_n, triton.next_power_of_2(n))),
            max(16, min(block_k // k_scale, triton.next_power_of_2(k))), warps, stages)


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the padded pair count: each expert hit (at most min(P, E)) pads at most block_m - 1."""
    bound = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return -(-bound // block_m) * block_m


def fused_moe_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
    """Torch reference (the CPU path and the oracle): a loop over the experts hit (a host sync). x [N, H];
    gate_up [E, 2I, H] (gate rows first); down [E, H, I]; topk_weights [N, k] fp32; topk_ids [N, k] int32/int64
    -> [N, H] in x.dtype; ``reduce=False``: each pair's weighted product [N, k, H] in fp32 instead, whose sum over
    k (then the cast) is the result, for a caller that fuses the sum with what follows. Ids outside [0, E)
    contribute nothing."""
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


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert in blocks of one expert, with device ops of static shapes. topk_ids [N, k] ->
    (sorted_pair_ids [max_padded] int32: pairs p = n * k + j by expert (stable), each expert's group padded to a
    multiple of block_m with the sentinel P = N * k, the sentinel past num_padded too; block_expert
    [max_padded / block_m] int32: each block's expert, -1 past num_padded; num_padded [1] int32). Ids outside
    [0, E) are left out."""
    ids = topk_ids.flatten().long()
    num_pairs, device = ids.numel(), ids.device
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    ids = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # expert E: left out
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = torch.cat([ends - padded, ends.new_zeros(1)])
    firsts = counts.cumsum(0) - counts  # each expert's first index in the sorted order
    order = torch.argsort(ids, stable=True)
    expert = ids[order]
    slot = starts[expert] + torch.arange(num_pairs, device=device) - firsts[expert]  # start + rank in its group
    slot = torch.where(expert < num_experts, slot, max_padded)  # left-out pairs go to a dropped last slot
    sorted_pair_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, slot, order.int())
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_starts, right=True)  # experts whose blocks end at or before
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).int()
    return sorted_pair_ids[:max_padded], block_expert, ends[-1:].int()


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_align_ref` in one Triton launch (one program) on CUDA for up to MAX_ALIGN_PAIRS pairs and
    MAX_ALIGN_EXPERTS experts; else the reference (static shapes too, so graph-safe, in two dozen small launches).
    Same signature and results (the order is stable here too); block_m a power of two."""
    num_pairs = topk_ids.numel()
    if not (kernels.runs_kernel(topk_ids) and 0 < num_pairs <= MAX_ALIGN_PAIRS and num_experts <= MAX_ALIGN_EXPERTS
            and topk_ids.is_contiguous() and topk_ids.dtype in (torch.int32, torch.int64)):
        return moe_align_ref(topk_ids, num_experts, block_m)
    assert block_m & (block_m - 1) == 0, block_m
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    sorted_pair_ids = torch.empty(max_padded, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(max_padded // block_m, dtype=torch.int32, device=topk_ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=topk_ids.device)
    experts = triton.next_power_of_2(num_experts)
    block_p = max(16, min(128, ALIGN_TILE // experts))
    _moe_align_kernel[(1,)](topk_ids, sorted_pair_ids, block_expert, num_padded, num_pairs, num_experts, max_padded,
                            BLOCK_M=block_m, EXPERTS=experts, BLOCK_P=block_p, BLOCK_B=block_p, FILL=1024,
                            num_warps=8)
    return sorted_pair_ids, block_expert, num_padded


def supports(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor) -> bool:
    """Whether :func:`fused_moe` takes its kernels for these operands."""
    return (kernels.runs_kernel(x) and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.dim() == 2
            and x.stride(1) == 1 and gate_up.dtype == down.dtype == x.dtype and gate_up.is_contiguous()
            and down.is_contiguous() and topk_ids.dtype in (torch.int32, torch.int64) and topk_ids.dim() == 2
            and topk_ids.is_contiguous() and topk_weights.shape == topk_ids.shape
            and topk_weights.dtype == torch.float32 and topk_weights.is_contiguous())


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
    """The Triton kernels where :func:`supports` says so, else the reference. Same signature as
    :func:`fused_moe_ref`, except that ids must lie in [0, E) here (a router's top-k does): a pair of another id
    is never computed and its row of the sum is garbage."""
    if not supports(x, gate_up, down, topk_weights, topk_ids):
        return fused_moe_ref(x, gate_up, down, topk_weights, topk_ids, reduce)
    (num_tokens, hidden), (num_experts, _, inter), top_k = x.shape, down.shape, topk_ids.shape[1]
    assert gate_up.shape == (num_experts, 2 * inter, hidden) and down.shape[1] == hidden, (gate_up.shape, down.shape)
    assert topk_ids.shape[0] == num_tokens, (topk_ids.shape, x.shape)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return x.new_zeros(num_tokens, hidden) if reduce else x.new_zeros(num_tokens, top_k, hidden,
                                                                          dtype=torch.float32)
    tiles = tile_config(num_pairs, num_experts, hidden, inter, x.dtype)
    sorted_pair_ids, block_expert, num_padded = moe_align(topk_ids, num_experts, tiles.block_m)
    blocks = (sorted_pair_ids, block_expert, num_padded, num_pairs)
    flags = {"FP32": x.dtype == torch.float32, "CUDA": x.is_cuda}
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [P, I]: silu(gate) * up per pair
    block_n, block_k, num_warps, num_stages = tiles.gate_up
    _gate_up_kernel[(block_expert.shape[0], triton.cdiv(inter, block_n))](
        x, gate_up, h, *blocks, top_k, hidden, inter, x.stride(0), BLOCK_M=tiles.block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, **flags, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False)
    # fp32: the weighted products are summed in fp32 (the rounding once at the end that the reference has)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    block_n, block_k, num_warps, num_stages = tiles.down
    _down_kernel[(block_expert.shape[0], triton.cdiv(hidden, block_n))](
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
    @triton.jit
    def _moe_align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts, max_padded,
                          BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr,
                          FILL: tl.constexpr):
        """One program. Counts per expert -> padded groups (starts, ends); each pair to its expert's start plus
        the pairs of that expert before it (earlier tiles: ``seen``; its own tile: a triangle of comparisons), so
        the order is stable; then the padding slots and each block's expert. Every slot is written exactly once
        (pairs, each group's padding, the tail past num_padded), so no barrier orders the stores."""
        experts = tl.arange(0, EXPERTS)
        offs = tl.arange(0, BLOCK_P)
        counts = tl.zeros((EXPERTS,), dtype=tl.int32)
        for p0 in range(0, num_pairs, BLOCK_P):
            ids = _load_ids(ids_ptr, p0 + offs, num_pairs, num_experts)
            counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        starts = ends - padded
        num_padded = tl.sum(padded, 0)
        tl.store(num_padded_ptr, num_padded)
        seen = tl.zeros((EXPERTS,), dtype=tl.int32)
        for p0 in range(0, num_pairs, BLOCK_P):
            ids = _load_ids(ids_ptr, p0 + offs, num_pairs, num_experts)
            hit = ids[:, None] == experts[None, :]  # [BLOCK_P, EXPERTS]
            base = tl.sum(tl.where(hit, (starts + seen)[None, :], 0), axis=1)
            same_before = (ids[:, None] == ids[None, :]) & (offs[None, :] < offs[:, None])  # [BLOCK_P, BLOCK_P]
            slot = base + tl.sum(same_before.to(tl.int32), axis=1)
            tl.store(sorted_ptr + slot, p0 + offs, mask=ids >= 0)
            seen += tl.sum(hit.to(tl.int32), axis=0)
        pad_slots = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]  # [EXPERTS, BLOCK_M]
        tl.store(sorted_ptr + pad_slots, num_pairs, mask=pad_slots < ends[:, None])
        for s0 in range(0, max_padded, FILL):
            s = s0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + s, num_pairs, mask=(s >= num_padded) & (s < max_padded))
        num_blocks = max_padded // BLOCK_M
        for b0 in range(0, num_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            # a block's expert: the number of groups that end at or before its first slot
            expert = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, tl.where(expert < num_experts, expert, -1), mask=b < num_blocks)

    @triton.jit
    def _load_ids(ids_ptr, pairs, num_pairs, num_experts):
        """The pairs' experts as int32, -1 for pairs past the end and ids outside [0, E)."""
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
        return tl.where((ids >= 0) & (ids < num_experts), ids, -1)

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
    def _gate_up_kernel(x_ptr, w_ptr, h_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, top_k,
                        hidden, inter, stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, FP32: tl.constexpr, CUDA: tl.constexpr):
        """Program (block of sorted pairs m, columns n): the tokens' rows of x times expert e's gate rows n and up
        rows I + n over all of H, two accumulators; stores silu(gate) * up for its pairs, rounded as the stock
        ops round (each product, silu, the SwiGLU product to x's dtype; CUDA's expf and an IEEE division)."""
        pid_m = tl.program_id(0)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
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
    def _down_kernel(h_ptr, w_ptr, weights_ptr, y_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                     hidden, inter, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     FP32: tl.constexpr, CUDA: tl.constexpr):
        """Program (block of sorted pairs m, columns n): the pairs' SwiGLU rows times expert e's down rows n over
        all of I, rounded to x's dtype, times the pair's fp32 routing weight; stored in fp32."""
        pid_m = tl.program_id(0)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
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
