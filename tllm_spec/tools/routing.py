"""The experts a mixture-of-experts target's steps read: its MoE layers, their routing logged over a run, and the
distinct experts of each layer per decoding step (a step reads an expert once, however many of its tokens went
there: neither every expert nor top_k per token)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..model.moe import MoE


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer of a target: the fused :class:`MoE`, or a stock HF block (an ``experts`` child holding
    gate_up_proj [E, 2I, H] and down_proj [E, H, I], a ``gate`` router returning (logits, weights, ids))."""

    module: nn.Module
    num_experts: int
    top_k: int
    expert_bytes: int  # one expert's gate_up + down weights
    expert_params: tuple[torch.Tensor, ...]  # the [E, 2I, H] and [E, H, I] tensors of all experts


@dataclass(frozen=True)
class Routing:
    """Distinct experts per MoE layer, averaged over the decoding steps of a run."""

    distinct_per_layer: tuple[float, ...]  # [L] mean distinct experts of each MoE layer per decoding step
    expert_bytes: tuple[int, ...]  # [L] bytes of one of the layer's experts
    num_steps: int  # decoding steps averaged

    @property
    def mean_distinct(self) -> float:
        """Distinct experts per MoE layer per step, averaged over the layers too."""
        return sum(self.distinct_per_layer) / len(self.distinct_per_layer)

    @property
    def bytes_per_step(self) -> float:
        """Expert weights a decoding step reads: sum over layers of distinct experts x one expert's bytes."""
        return sum(d * b for d, b in zip(self.distinct_per_layer, self.expert_bytes))


def moe_layers(target: nn.Module) -> list[MoELayer]:
    """The MoE layers a forward of ``target`` runs, in order: its :class:`MoE` modules (the fused path), else its
    stock HF MoE blocks; [] for a dense target."""
    fused = [m for m in target.modules() if isinstance(m, MoE)]
    if fused:
        return [MoELayer(m, m.num_experts, m.top_k, m.expert_bytes, (m.gate_up, m.down)) for m in fused]
    return [_stock_layer(m) for m in target.modules() if _is_stock_block(m)]


def moe_summary(target: nn.Module) -> dict | None:
    """What the benchmark's JSON says of a target's MoE layers (None: a dense target): their number, experts and
    top-k (the first layer's), one expert's bytes, every layer's experts' bytes and whether they run fused."""
    layers = moe_layers(target)
    if not layers:
        return None
    return {"num_moe_layers": len(layers), "num_experts": layers[0].num_experts, "top_k": layers[0].top_k,
            "expert_bytes": layers[0].expert_bytes,
            "all_experts_bytes": sum(layer.num_experts * layer.expert_bytes for layer in layers),
            "fused": isinstance(layers[0].module, MoE)}


def _is_stock_block(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    tensors = [getattr(experts, name, None) for name in ("gate_up_proj", "down_proj")]
    return hasattr(module, "gate") and all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in tensors)


def _stock_layer(block: nn.Module) -> MoELayer:
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    expert_bytes = gate_up[0].numel() * gate_up.element_size() + down[0].numel() * down.element_size()
    return MoELayer(block, gate_up.shape[0], block.gate.top_k, expert_bytes, (gate_up, down))


@contextlib.contextmanager
def routing_logs(layers: list[MoELayer]) -> Iterator[list[list[torch.Tensor]]]:
    """Inside the block, every eager forward of each layer appends its expert ids [N, k] to that layer's list (one
    list per layer; a :class:`MoE` through its ``routing_log``, a stock block through a hook on its router).
    Compiled code and CUDA-graph replays append nothing. Refuses nesting over fused layers (a stock block would
    log each forward twice)."""
    logs: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = []
    fused = [layer.module for layer in layers if isinstance(layer.module, MoE)]
    if any(m.routing_log is not None for m in fused):
        raise RuntimeError("routing_logs: the layers' routing is already being logged")
    try:
        for layer, log in zip(layers, logs):
            if isinstance(layer.module, MoE):
                layer.module.routing_log = log
            else:
                hooks.append(layer.module.gate.register_forward_hook(
                    lambda module, args, out, log=log: log.append(out[2])))  # out: (logits, weights, ids)
        yield logs
    finally:
        for hook in hooks:
            hook.remove()
        for module in fused:
            module.routing_log = None


def distinct_experts(logs: list[list[torch.Tensor]], num_experts: list[int], max_rows: int) -> torch.Tensor:
    """[S, L] int64: the distinct experts of layer l in decoding step s, from :func:`routing_logs`' lists (entry j
    of every layer's list is forward j). A forward of more than ``max_rows`` tokens (batch x (draft_len + 1)) is a
    prompt step, left out."""
    lengths = {len(log) for log in logs}
    if len(lengths) != 1:
        raise ValueError(f"the MoE layers logged different numbers of forwards ({sorted(lengths)})")
    steps = [j for j in range(lengths.pop()) if logs[0][j].shape[0] <= max_rows]
    if not steps:
        return torch.zeros(0, len(logs), dtype=torch.int64)
    counts = [torch.stack([_num_distinct(log[j], e) for log, e in zip(logs, num_experts)]) for j in steps]
    return torch.stack(counts).cpu()  # one host sync for the whole run


def _num_distinct(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids [N, k] -> () int64: how many experts appear (on the device, no host sync)."""
    hit = torch.zeros(num_experts, dtype=torch.bool, device=ids.device)
    return hit.index_fill_(0, ids.flatten().long(), True).sum()


def routing_of(layers: list[MoELayer], logs: list[list[torch.Tensor]], max_rows: int) -> Routing:
    """The :class:`Routing` of a run logged by :func:`routing_logs`, over its decoding steps."""
    counts = distinct_experts(logs, [layer.num_experts for layer in layers], max_rows)
    if not len(counts):
        raise ValueError(f"no decoding step in the routing log (every forward had more than {max_rows} tokens)")
    return Routing(tuple(counts.double().mean(0).tolist()), tuple(layer.expert_bytes for layer in layers), len(counts))
