"""MoE: a mixture-of-experts MLP in the fused path: router, top-k, the experts through one fused kernel, shared
experts. One class covers the three routings the supported families use:

* Qwen3-MoE: softmax over the router logits (computed in the model dtype), top-k, optionally renormalised
  (``norm_topk_prob``); the weights rounded to the model dtype as the stock router rounds them.
* Mixtral: the same softmax routing, always renormalised, weights kept in fp32.
* GLM-4.5 (Glm4Moe): fp32 logits, sigmoid scores; the choice adds ``e_score_correction_bias`` and keeps only the
  ``topk_group`` best of ``n_group`` expert groups (a group's score: its two best experts); the weights are the
  chosen experts' scores (without the bias), renormalised, times ``routed_scaling_factor``; plus shared experts.

The experts are the stock module's own tensors, shared not copied: gate|up ``[E, 2I, H]`` (gate rows first) and
down ``[E, H, I]``. :func:`~tllm_spec.kernels.fused_moe.fused_moe` runs gate/up with the SwiGLU product in its
epilogue and down with the routing weight in its, with no host synchronisation (the expert counts stay on the
device), so a step with MoE layers stays one CUDA graph; on the CPU its torch reference.

Tensor parallel (``tp_group``): each rank holds every expert's slice of the intermediate dimension (the router
whole), so the routed and shared experts' outputs are partial sums, added and all-reduced once.
"""
from __future__ import annotations

import torch
from torch import nn

from ..distributed.parallel import all_reduce_add_norm
from ..kernels.fused_moe import fused_moe, fused_moe_ref
from ..kernels.moe_topk import moe_topk, moe_topk_ref
from ..kernels.router_logits import router_logits, router_logits_ref
from ..kernels.skinny_linear import skinny_linear, skinny_linear_ref
from .layers import MLP, traced

ROUTERS = {"Qwen3MoeTopKRouter": "softmax", "MixtralTopKRouter": "softmax", "Glm4MoeTopkRouter": "sigmoid"}
BLOCKS = ("Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock", "Glm4MoeMoE")


def unsupported(block: nn.Module) -> str | None:
    """Why the stock MoE ``block`` cannot run in the fused path (None: it can)."""
    name = type(block).__name__
    if name not in BLOCKS:
        return f"{name} is not one of the supported MoE blocks ({', '.join(BLOCKS)})"
    router, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    if type(router).__name__ not in ROUTERS:
        return f"{name}: router {type(router).__name__} is not one of {', '.join(ROUTERS)}"
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3):
        return f"{name}: experts without the fused [E, 2I, H] gate_up_proj and [E, H, I] down_proj tensors"
    if type(getattr(experts, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return f"{name}: expert activation {type(getattr(experts, 'act_fn', None)).__name__}, not SiLU"
    shared = getattr(block, "shared_experts", None)
    if shared is not None and not all(isinstance(getattr(shared, k, None), nn.Linear)
                                      for k in ("gate_proj", "up_proj", "down_proj")):
        return f"{name}: shared experts of type {type(shared).__name__}"
    return None


class MoE(nn.Module):
    """x [N, H] -> sum over its top-k experts of weight * expert(x) (+ shared experts) [N, H]."""

    def __init__(self, router: nn.Module, gate_up: torch.Tensor, down: torch.Tensor, scoring: str, top_k: int,
                 norm_topk_prob: bool, shared: MLP | None = None):
        super().__init__()
        self.router, self.shared, self.scoring, self.top_k = router, shared, scoring, top_k
        self.gate_up, self.down = gate_up, down  # the stock experts' parameters (registered there, not here)
        self.norm_topk_prob = norm_topk_prob
        self.num_experts = gate_up.shape[0]
        self.n_group = getattr(router, "num_group", 1) or 1
        self.topk_group = getattr(router, "topk_group", 1) or 1
        self.scaling = float(getattr(router, "routed_scaling_factor", 1.0) or 1.0)
        # Qwen3's router rounds its weights to the model dtype; Mixtral's and GLM's stay fp32
        self.round_weights = type(router).__name__ == "Qwen3MoeTopKRouter"
        self.tp_group: str | None = None
        self.routing_log: list[torch.Tensor] | None = None  # eager forwards append their topk_ids (benchmarks)

    @classmethod
    def from_hf(cls, block: nn.Module) -> MoE:
        """The fused form of a supported stock MoE block (check :func:`unsupported` first)."""
        router = block.gate
        shared = getattr(block, "shared_experts", None)
        norm_topk = getattr(router, "norm_topk_prob", type(router).__name__ == "MixtralTopKRouter")
        return cls(router, block.experts.gate_up_proj, block.experts.down_proj, ROUTERS[type(router).__name__],
                   router.top_k, bool(norm_topk),
                   MLP.from_linears(shared.gate_proj, shared.up_proj, shared.down_proj) if shared is not None
                   else None)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (this rank's slice): what a step reads per distinct routed expert."""
        return (self.gate_up[0].numel() * self.gate_up.element_size()
                + self.down[0].numel() * self.down.element_size())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (routing weights [N, k] fp32, expert ids [N, k] int32), the stock router's maths: logits in
        the model dtype (softmax routers; a few rows' sums ordered as the skinny GEMM orders them) or fp32 (GLM; a
        few rows through kernels/router_logits.py), the choice in one launch on CUDA (kernels/moe_topk.py, which
        widens 16-bit logits itself)."""
        weight = self.router.weight
        if self.scoring == "softmax":  # a decoding step's few rows through the skinny GEMM (kernels/skinny_linear.py)
            project = traced(torch.ops.tllm_spec.skinny_linear, skinny_linear) if x.is_cuda else skinny_linear_ref
            logits = project(x, weight.to(x.dtype), None)
        else:
            project = traced(torch.ops.tllm_spec.router_logits, router_logits) if x.is_cuda else router_logits_ref
            logits = project(x, weight)
        bias = getattr(self.router, "e_score_correction_bias", None)
        round_to = {torch.bfloat16: 1, torch.float16: 2}.get(x.dtype, 0) if self.round_weights else 0
        choose = traced(torch.ops.tllm_spec.moe_topk, moe_topk) if x.is_cuda else moe_topk_ref
        return choose(logits, None if bias is None else bias.float(), self.top_k, self.scoring == "sigmoid",
                      self.norm_topk_prob, self.scaling, round_to, self.n_group, self.topk_group)

    def forward(self, x: torch.Tensor, gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H] -> [N, H] (plus ``residual``); ``gated``: the shared experts' SwiGLU is their GEMM's epilogue
        (the dense MLP's few-row path)."""
        weights, ids = self.route(x)
        if self.routing_log is not None and not torch.compiler.is_compiling():
            self.routing_log.append(ids)
        if x.is_cuda:  # the sum over each token's k experts (fp32) and the cast fuse with the adds below
            pairs = traced(torch.ops.tllm_spec.fused_moe, fused_moe)(x, self.gate_up, self.down, weights, ids, False)
            out = pairs.sum(dim=1).to(x.dtype)
        else:
            out = fused_moe_ref(x, self.gate_up, self.down, weights, ids)
        if self.shared is not None:
            out = out + self.shared(x, gated=gated)
        if self.tp_group is not None:  # the all-reduce and the add: one kernel in a decoding step
            return all_reduce_add_norm(out, residual, None, 0.0, self.tp_group)[0]
        return out if residual is None else residual + out
