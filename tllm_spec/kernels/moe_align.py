"""The (token, expert) pairs of a mixture-of-experts layer sorted by expert into blocks of one expert, with no host
synchronisation: :mod:`.fused_moe`'s grouped GEMMs run over those blocks on static grids.

The P = N * k pairs p = n * k + j are ordered by expert (stably) and each expert's group is padded to a multiple of
``block_m`` with the sentinel P; the padded pair count stays on the device (``num_padded``), bounded on the host by
:func:`max_padded_pairs`.
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

# every program of moe_align's placing launch reads all tiles' counts ([tiles, experts]), which grows with the square
# of the pairs: past these sizes prompt chunks take the torch reference's two dozen small launches instead
MAX_ALIGN_PAIRS = 4096
MAX_ALIGN_EXPERTS = 1024
ALIGN_TILE = 8192  # elements of a program's [pairs, experts] comparison tile (and of its [tiles, experts] loads)


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the padded pair count: each expert hit (at most min(P, E)) pads at most block_m - 1."""
    bound = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return -(-bound // block_m) * block_m


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
    """:func:`moe_align_ref` in two Triton launches on CUDA for up to MAX_ALIGN_PAIRS pairs and MAX_ALIGN_EXPERTS
    experts, one program per tile of pairs in each: every tile's count per expert, then every tile places its
    pairs (all tiles' counts give the groups, the earlier tiles' counts its offsets in them) and a share of the
    padding; else the reference (static shapes too, so graph-safe, in two dozen small launches). Same signature and
    results (the order is stable here too); block_m a power of two."""
    num_pairs = topk_ids.numel()
    if not (kernels.runs_kernel(topk_ids) and 0 < num_pairs <= MAX_ALIGN_PAIRS and num_experts <= MAX_ALIGN_EXPERTS
            and topk_ids.is_contiguous() and topk_ids.dtype in (torch.int32, torch.int64)):
        return moe_align_ref(topk_ids, num_experts, block_m)
    assert block_m & (block_m - 1) == 0, block_m
    device = topk_ids.device
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    sorted_pair_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    experts = triton.next_power_of_2(num_experts)
    block_p = max(16, min(128, ALIGN_TILE // experts))
    num_tiles = triton.cdiv(num_pairs, block_p)
    counts = torch.empty(num_tiles, experts, dtype=torch.int32, device=device)  # [tile, expert]
    pdl = dependent_launch.launches_dependent(topk_ids)
    launch = {"PDL": pdl, "num_warps": 4, **dependent_launch.launch_options(pdl)}
    _count_kernel[(num_tiles,)](topk_ids, counts, num_pairs, num_experts, EXPERTS=experts, BLOCK_P=block_p, **launch)
    _place_kernel[(num_tiles,)](topk_ids, counts, sorted_pair_ids, block_expert, num_padded, num_pairs, num_experts,
                                max_padded, num_tiles, BLOCK_M=block_m, EXPERTS=experts, BLOCK_P=block_p,
                                CHUNK=max(1, ALIGN_TILE // experts), BLOCK_B=block_p, FILL=1024, **launch)
    return sorted_pair_ids, block_expert, num_padded


if triton is not None:
    from .dependent_launch import wait_and_release

    @triton.jit
    def _count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, EXPERTS: tl.constexpr, BLOCK_P: tl.constexpr,
                      PDL: tl.constexpr):
        """Program t: tile t's pairs counted per expert -> counts[t, :]. PDL (both kernels): a programmatic
        dependent (:mod:`.dependent_launch`) of the kernel before, which wrote what it reads."""
        tile = tl.program_id(0)
        if PDL:
            wait_and_release()
        experts = tl.arange(0, EXPERTS)
        ids = _load_ids(ids_ptr, tile * BLOCK_P + tl.arange(0, BLOCK_P), num_pairs, num_experts)
        count = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        tl.store(counts_ptr + tile * EXPERTS + experts, count)

    @triton.jit
    def _place_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts,
                      max_padded, num_tiles, BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_P: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK_B: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr):
        """Program t. All tiles' counts -> padded groups (starts, ends); each pair of tile t to its expert's start
        plus the pairs of that expert before it (earlier tiles' counts, then a triangle of comparisons in its own
        tile), so the order is stable; then its share of the rest (the padding of the experts e = t mod tiles, a
        strided share of the tail past num_padded and of the blocks' experts). Every slot is written exactly once
        over all programs, so no barrier orders the stores."""
        tile = tl.program_id(0)
        if PDL:
            wait_and_release()
        programs = tl.num_programs(0)
        experts = tl.arange(0, EXPERTS)
        totals = tl.zeros((EXPERTS,), dtype=tl.int32)
        before = tl.zeros((EXPERTS,), dtype=tl.int32)
        for t0 in range(0, num_tiles, CHUNK):
            tiles = t0 + tl.arange(0, CHUNK)
            count = tl.load(counts_ptr + tiles[:, None] * EXPERTS + experts[None, :],
                            mask=(tiles < num_tiles)[:, None], other=0)
            totals += tl.sum(count, axis=0)
            before += tl.sum(tl.where((tiles < tile)[:, None], count, 0), axis=0)
        padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        starts = ends - padded
        num_padded = tl.sum(padded, 0)
        if tile == 0:
            tl.store(num_padded_ptr, num_padded)
        offs = tl.arange(0, BLOCK_P)
        ids = _load_ids(ids_ptr, tile * BLOCK_P + offs, num_pairs, num_experts)
        hit = ids[:, None] == experts[None, :]  # [BLOCK_P, EXPERTS]
        base = tl.sum(tl.where(hit, (starts + before)[None, :], 0), axis=1)
        same_before = (ids[:, None] == ids[None, :]) & (offs[None, :] < offs[:, None])  # [BLOCK_P, BLOCK_P]
        slot = base + tl.sum(same_before.to(tl.int32), axis=1)
        tl.store(sorted_ptr + slot, tile * BLOCK_P + offs, mask=ids >= 0)
        pad_slots = (starts + totals)[:, None] + tl.arange(0, BLOCK_M)[None, :]  # [EXPERTS, BLOCK_M]
        mine = (experts % programs) == tile
        tl.store(sorted_ptr + pad_slots, num_pairs, mask=(pad_slots < ends[:, None]) & mine[:, None])
        for s0 in range(tile * FILL, max_padded, programs * FILL):
            s = s0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + s, num_pairs, mask=(s >= num_padded) & (s < max_padded))
        num_blocks = max_padded // BLOCK_M
        for b0 in range(tile * BLOCK_B, num_blocks, programs * BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            # a block's expert: the number of groups that end at or before its first slot
            expert = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, tl.where(expert < num_experts, expert, -1), mask=b < num_blocks)

    @triton.jit
    def _load_ids(ids_ptr, pairs, num_pairs, num_experts):
        """The pairs' experts as int32, -1 for pairs past the end and ids outside [0, E)."""
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
        return tl.where((ids >= 0) & (ids < num_experts), ids, -1)
