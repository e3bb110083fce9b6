"""A tensor-parallel rank's part of a mixture-of-experts layer: every expert's slice of the intermediate dimension
(gate and up rows, down columns), the shared experts split like a dense MLP, the router whole.

In memory (transformers' layout) the experts of a layer are two tensors, ``mlp.experts.gate_up_proj`` [E, 2I, H]
(gate rows, then up rows) and ``mlp.experts.down_proj`` [E, H, I]; a rank's gate|up slice is two ranges of rows.
On disk they are either the same two tensors or one tensor per expert and projection, as the published
checkpoints store them: ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (Qwen3-MoE, GLM-4.5) or
``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` with the router at ``block_sparse_moe.gate.weight``
(Mixtral). :func:`disk_reads` says which on-disk slices make a rank's tensor.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from transformers import PretrainedConfig

_FUSED = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<which>gate_up_proj|down_proj)$")
_SHARED = re.compile(r"\.mlp\.shared_experts\.(?P<proj>gate|up|down)_proj\.weight$")
_ROUTER = re.compile(r"^(?P<layer>.+)\.mlp\.gate\.(?P<what>weight|e_score_correction_bias)$")
_PER_EXPERT = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}


@dataclass(frozen=True)
class Shard:
    """Indices [start, stop) along ``dim`` of a tensor; ``halves``: along ``dim`` the tensor is two equal halves
    (gate | up) and the range is taken from each; ``zero``: a row-parallel bias off rank 0 (kept as zeros)."""

    dim: int
    start: int
    stop: int
    zero: bool = False
    halves: bool = False

    def size(self, full: int) -> int:
        """Length along ``dim`` of the shard of a tensor ``full`` long there."""
        return 2 * (self.stop - self.start) if self.halves else min(self.stop, full) - self.start

    def ranges(self, full: int) -> list[tuple[int, int]]:
        """The [start, stop) ranges along ``dim`` that make the shard, in order."""
        if not self.halves:
            return [(self.start, min(self.stop, full))]
        half = full // 2
        return [(self.start, self.stop), (half + self.start, half + self.stop)]


def moe_intermediate_size(config: PretrainedConfig) -> int:
    """One expert's intermediate size (Mixtral calls it ``intermediate_size``)."""
    return getattr(config, "moe_intermediate_size", None) or config.intermediate_size


def shared_intermediate_size(config: PretrainedConfig) -> int:
    return moe_intermediate_size(config) * (getattr(config, "n_shared_experts", None) or 0)


def expert_shard(name: str, config: PretrainedConfig, split) -> Shard | None | bool:
    """This rank's part of an MoE tensor ``name`` (``split(total)`` -> this rank's [start, stop)); None: whole;
    False: not an MoE tensor."""
    fused = _FUSED.match(name)
    if fused:
        start, stop = split(moe_intermediate_size(config))
        return Shard(1, start, stop, halves=True) if fused.group("which") == "gate_up_proj" else Shard(2, start, stop)
    shared = _SHARED.search(name)
    if shared:
        start, stop = split(shared_intermediate_size(config))
        return Shard(1 if shared.group("proj") == "down" else 0, start, stop)
    return None if _ROUTER.match(name) else False


def disk_reads(name: str, shard: Shard | None, files: dict[str, str], num_experts: int
               ) -> list[tuple[str, Shard | None]] | None:
    """How to read the in-memory tensor ``name`` from a checkpoint whose tensor names are ``files``: a list of
    (on-disk name, its shard) to stack along a new first dimension (one per expert), or None to read ``name``
    itself. Mixtral's router is read from ``block_sparse_moe.gate.weight``."""
    if name in files:
        return None
    router = _ROUTER.match(name)
    if router:
        alias = f"{router.group('layer')}.block_sparse_moe.gate.{router.group('what')}"
        return [(alias, shard)] if alias in files else None
    fused = _FUSED.match(name)
    if fused is None:
        return None
    layer = fused.group("layer")
    projections = ("gate", "up") if fused.group("which") == "gate_up_proj" else ("down",)
    for block, index in (("mlp", 0), ("block_sparse_moe", 1)):
        names = [[f"{layer}.{block}.experts.{e}.{_PER_EXPERT[p][index]}.weight" for p in projections]
                 for e in range(num_experts)]
        if all(n in files for per_expert in names for n in per_expert):
            # per expert: gate and up are [I, H] (rows sliced), down [H, I] (columns sliced)
            part = None if shard is None else Shard(shard.dim - 1, shard.start, shard.stop)
            return [(n, part) for per_expert in names for n in per_expert]
    missing = f"{layer}.mlp.experts.0.{_PER_EXPERT[projections[0]][0]}.weight"
    raise ValueError(f"tensor {name!r} is neither in the checkpoint nor stored per expert (no {missing!r} and "
                     "the other experts' tensors)")


def num_experts(config: PretrainedConfig) -> int:
    return (getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
            or getattr(config, "num_local_experts", None) or 0)
