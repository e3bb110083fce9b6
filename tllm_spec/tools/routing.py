"""The experts a mixture-of-experts target's steps read: its MoE layers, their routing logged over a run, and the
distinct experts of each layer per decoding step (a step reads an expert once, however many of its tokens went
there: neither every expert nor top_k per token). A draft's MoE layers (GLM-4.5's MTP block) run several passes a
step, each a forward of its own: per step they read the distinct experts of each pass, summed over the passes."""
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
    # [L_draft] the draft's MoE layers: experts read per decoding step (each pass's distinct ones, summed), mean
    draft_experts_per_layer: tuple[float, ...] = ()
    draft_expert_bytes: tuple[int, ...] = ()  # [L_draft] bytes of one of the draft layer's experts

    @property
    def mean_distinct(self) -> float:
        """Distinct experts per MoE layer per step, averaged over the layers too."""
        return sum(self.distinct_per_layer) / len(self.distinct_per_layer)

    @property
    def bytes_per_step(self) -> float:
        """Expert weights a decoding step reads: sum over layers of distinct experts x one expert's bytes."""
        return sum(d * b for d, b in zip(self.distinct_per_layer, self.expert_bytes))

    @property
    def mean_draft_experts(self) -> float:
        """The draft's experts per decoding step, averaged over its MoE layers."""
        return sum(self.draft_experts_per_layer) / len(self.draft_experts_per_layer)

    @property
    def draft_bytes_per_step(self) -> float:
        """Expert weights a decoding step's draft passes read."""
        return sum(d * b for d, b in zip(self.draft_experts_per_layer, self.draft_expert_bytes))


class PassLog(list):
    """A draft MoE layer's routing log: each forward's expert ids, as a plain log, and in ``steps`` the number of
    target forwards logged (in ``step_log``) before each: the step it ran in, counted from 1."""

    def __init__(self, step_log: list[torch.Tensor]):
        super().__init__()
        self.step_log, self.steps = step_log, []

    def append(self, ids: torch.Tensor) -> None:
        self.steps.append(len(self.step_log))
        super().append(ids)


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
def routing_logs(layers: list[MoELayer], draft_layers: list[MoELayer] = ()) -> Iterator[list[list[torch.Tensor]]]:
    """Inside the block, every eager forward of each layer appends its expert ids [N, k] to that layer's list (one
    list per layer; a :class:`MoE` through its ``routing_log``, a stock block through a hook on its router).
    Compiled code and CUDA-graph replays append nothing. Refuses nesting over fused layers (a stock block would
    log each forward twice). ``draft_layers`` (a draft's, after the target's ``layers``, of which there is one
    at least) get their lists after the target's: :class:`PassLog` s, which note each forward's step."""
    logs: list[list[torch.Tensor]] = [[] for _ in layers]
    logs += [PassLog(logs[0]) for _ in draft_layers]
    layers = [*layers, *draft_layers]
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


def draft_experts(logs: list[PassLog], num_experts: list[int], step_log: list[torch.Tensor], max_rows: int
                  ) -> torch.Tensor:
    """[S, L_draft] int64: the experts draft layer l read in decoding step s, the distinct experts of each of its
    forwards in the step summed. The steps are the target's forwards in ``step_log`` (its first MoE layer's) of at
    most ``max_rows`` tokens, as in :func:`distinct_experts`."""
    counts = torch.zeros(len(step_log), len(logs), dtype=torch.int64)
    for layer, (log, experts) in enumerate(zip(logs, num_experts)):
        if log:
            distinct = torch.stack([_num_distinct(ids, experts) for ids in log]).cpu()  # one host sync a layer
            counts[:, layer].index_add_(0, torch.tensor(log.steps) - 1, distinct)
    return counts[[j for j, ids in enumerate(step_log) if ids.shape[0] <= max_rows]]


def routing_of(layers: list[MoELayer], logs: list[list[torch.Tensor]], max_rows: int,
               draft_layers: list[MoELayer] = ()) -> Routing:
    """The :class:`Routing` of a run logged by :func:`routing_logs` (with ``draft_layers`` if it logged those),
    over its decoding steps."""
    counts = distinct_experts(logs[:len(layers)], [layer.num_experts for layer in layers], max_rows)
    if not len(counts):
        raise ValueError(f"no decoding step in the routing log (every forward had more than {max_rows} tokens)")
    draft = draft_experts(logs[len(layers):], [layer.num_experts for layer in draft_layers], logs[0], max_rows)
    return Routing(tuple(counts.double().mean(0).tolist()), tuple(layer.expert_bytes for layer in layers), len(counts),
                   tuple(draft.double().mean(0).tolist()), tuple(layer.expert_bytes for layer in draft_layers))
