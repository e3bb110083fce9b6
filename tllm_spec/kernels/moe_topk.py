"""A mixture-of-experts router's choice from its logits in one launch: scores (softmax, or sigmoid plus a
correction bias for the choice), the top-k experts, their weights (renormalised, scaled, optionally rounded to the
model's 16-bit dtype as Qwen3's router rounds them). Stock torch runs this as softmax, a sort-based top-k (two
kernels), a division and casts: about 13 us of small launches per MoE layer of a decoding step on an H100, for a
[tokens, 128] problem.

The top-k is k rounds of an arg-max over the row (ties: the lowest expert index); GLM's grouped choice
(``n_group`` > 1) stays with the reference.
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

ROUNDING = {0: None, 1: torch.bfloat16, 2: torch.float16}  # round_to codes (a custom op takes no dtype argument)


def moe_topk_ref(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, sigmoid: bool, renormalize: bool,
                 scaling: float, round_to: int, n_group: int = 1, topk_group: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (the CPU path and the oracle). logits [N, E], fp32 or a router's 16-bit ones (widened to
    fp32 first); ``sigmoid``: scores sigmoid(logits), chosen by scores + ``bias`` [E] within the ``topk_group`` best
    of ``n_group`` groups (a group's score: its two best), else softmax(logits); weights: the chosen scores, divided
    by their sum if ``renormalize`` (+1e-20 for sigmoid), times ``scaling``, rounded to ROUNDING[round_to] if any ->
    (weights [N, k] fp32, ids [N, k] int32)."""
    logits = logits.float()
    if not sigmoid:
        top, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        if renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
    else:
        scores = logits.sigmoid()
        choice = scores + bias if bias is not None else scores
        if n_group > 1:
            experts = logits.shape[1]
            group_scores = choice.view(-1, n_group, experts // n_group).topk(2, dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(group_scores).scatter_(
                1, torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices, 1.0)
            choice = choice.masked_fill(~keep.bool().repeat_interleave(experts // n_group, dim=1), float("-inf"))
        ids = torch.topk(choice, top_k, dim=-1, sorted=False).indices
        top = scores.gather(1, ids)
        if renormalize:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    top = top * scaling
    if ROUNDING[round_to] is not None:
        top = top.to(ROUNDING[round_to]).float()
    return top, ids.to(torch.int32)


def moe_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, sigmoid: bool, renormalize: bool,
             scaling: float, round_to: int, n_group: int = 1, topk_group: int = 1
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on CUDA (one program per token, a programmatic dependent of the router's GEMM where
    :mod:`.dependent_launch` says so) for contiguous logits without grouping, else the reference. Same signature as
    :func:`moe_topk_ref`; the same experts (up to ties) and weights to an ulp. 16-bit logits are widened in the
    kernel: no cast launch between the router's GEMM and the choice."""
    num_tokens, num_experts = logits.shape
    if not (kernels.runs_kernel(logits) and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and logits.is_contiguous()
            and n_group == 1 and top_k <= num_experts and num_experts <= 1024):
        return moe_topk_ref(logits, bias, top_k, sigmoid, renormalize, scaling, round_to, n_group, topk_group)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        pdl = dependent_launch.launches_dependent(logits)
        _moe_topk_kernel[(num_tokens,)](
            logits, logits if bias is None else bias, weights, ids, num_experts, scaling, TOP_K=top_k,
            K_BLOCK=triton.next_power_of_2(top_k), EXPERTS=triton.next_power_of_2(num_experts), SIGMOID=sigmoid,
            BIAS=bias is not None, RENORMALIZE=renormalize, ROUND_TO=round_to, CUDA=logits.is_cuda, PDL=pdl,
            num_warps=1, **dependent_launch.launch_options(pdl))
    return weights, ids


@torch.library.custom_op("tllm_spec::moe_topk", mutates_args=())
def moe_topk_op(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, sigmoid: bool, renormalize: bool,
                scaling: float, round_to: int, n_group: int, topk_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_topk` as a torch op (opaque to torch.compile)."""
    return moe_topk(logits, bias, top_k, sigmoid, renormalize, scaling, round_to, n_group, topk_group)


@moe_topk_op.register_fake
def _(logits, bias, top_k, sigmoid, renormalize, scaling, round_to, n_group, topk_group):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape), logits.new_empty(shape, dtype=torch.int32)


if triton is not None:
    from .dependent_launch import wait_and_release

    @triton.jit
    def _moe_topk_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, scaling, TOP_K: tl.constexpr,
                         K_BLOCK: tl.constexpr, EXPERTS: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr,
                         RENORMALIZE: tl.constexpr, ROUND_TO: tl.constexpr, CUDA: tl.constexpr, PDL: tl.constexpr):
        """One token: scores of all experts, k arg-max rounds over the choice, weights of the chosen."""
        row = tl.program_id(0).to(tl.int64)
        experts = tl.arange(0, EXPERTS)
        valid = experts < num_experts
        if PDL:
            wait_and_release()
        logits = tl.load(logits_ptr + row * num_experts + experts, mask=valid, other=float("-inf")).to(tl.float32)
        if SIGMOID:
            scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-logits)), 0.0)
            choice = scores
            if BIAS:
                choice = scores + tl.load(bias_ptr + experts, mask=valid, other=0.0)
            choice = tl.where(valid, choice, float("-inf"))
        else:
            shifted = tl.exp(logits - tl.max(logits, 0))
            scores = shifted / tl.sum(shifted, 0)
            choice = tl.where(valid, scores, float("-inf"))
        slots = tl.arange(0, K_BLOCK)
        chosen_ids = tl.zeros((K_BLOCK,), dtype=tl.int32)
        chosen = tl.zeros((K_BLOCK,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.max(choice, 0)
            index = tl.min(tl.where(choice == best, experts, EXPERTS), 0)
            chosen_ids = tl.where(slots == j, index, chosen_ids)
            chosen = tl.where(slots == j, tl.sum(tl.where(experts == index, scores, 0.0), 0), chosen)
            choice = tl.where(experts == index, float("-inf"), choice)
        if RENORMALIZE:
            total = tl.sum(tl.where(slots < TOP_K, chosen, 0.0), 0)
            if SIGMOID:
                total += 1e-20
            chosen = chosen / total
        chosen = chosen * scaling
        if ROUND_TO == 1:
            if CUDA:
                chosen = chosen.to(tl.bfloat16).to(tl.float32)
            else:  # Triton's CPU interpreter casts to bf16 by truncation: round to nearest even by bits
                bits = chosen.to(tl.uint32, bitcast=True)
                chosen = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        elif ROUND_TO == 2:
            chosen = chosen.to(tl.float16).to(tl.float32)
        keep = slots < TOP_K
        tl.store(weights_ptr + row * TOP_K + slots, chosen, mask=keep)
        tl.store(ids_ptr + row * TOP_K + slots, chosen_ids, mask=keep)
