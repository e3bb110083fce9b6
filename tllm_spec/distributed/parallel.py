"""Tensor parallelism over torch.distributed: the process group, the shardability check and the three
collectives of the step (all-reduce after row-parallel GEMMs, the vocabulary gather of the sampled rows, the
broadcast of the step outputs), plus one vote at load time (:func:`all_ranks_agree`).

Collectives are ``torch.ops._c10d_functional`` ops: the same op runs eagerly (gloo on CPU, NCCL on GPU),
traces under torch.compile and is captured into CUDA graphs with NCCL.
"""
from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from ..kernels.rms_norm import rms_norm, rms_norm_ref
from . import lamport, symmetric

_c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group (``size`` ranks, all of them: one target)."""

    rank: int
    size: int
    group_name: str

    @classmethod
    def setup(cls, size: int, device: torch.device) -> TensorParallel:
        """Join (or check) the default process group of ``size`` ranks. Run under ``torchrun --nproc-per-node
        size``; a process group already initialised (tests) is used as is. Raises the same error on every rank
        before any collective when the world does not match ``size``."""
        if not dist.is_initialized():
            world = int(os.environ.get("WORLD_SIZE", "1"))
            if world != size:
                raise ValueError(f"tensor_parallel_size={size} but this process was started with WORLD_SIZE="
                                 f"{world}; launch with torchrun --nproc-per-node {size}")
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            atexit.register(_destroy_process_group)  # ours to close: see there
        if dist.get_world_size() != size:
            raise ValueError(f"tensor_parallel_size={size} but the torch.distributed world has "
                             f"{dist.get_world_size()} ranks; launch with torchrun --nproc-per-node {size}")
        return cls(dist.get_rank(), size, dist.group.WORLD.group_name)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def split(self, total: int) -> tuple[int, int]:
        """[start, stop) of this rank's equal part of ``total`` (which ``size`` divides)."""
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """[start, stop) of this rank's KV heads: an equal part, or one head replicated over
        ``size / num_kv_heads`` ranks when there are fewer KV heads than ranks."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        head = self.rank * num_kv_heads // self.size
        return head, head + 1

    def padded_vocab(self, vocab_size: int) -> int:
        """Rows per rank of the vocabulary-parallel lm_head (the last rank's tail is zero padding)."""
        return -(-vocab_size // self.size)


def _destroy_process_group() -> None:
    """Close the default process group at interpreter exit (registered only where :meth:`TensorParallel.setup`
    opened it; a caller's own group is the caller's to close), after every open model has released the CUDA
    graphs that captured its collectives (:meth:`tllm_spec.SpecModel.close`, whose exit hook runs first: NCCL
    cannot close a communicator such graphs still use, and finished ranks hung here on 2 H200s). A process that
    exits on an unhandled exception aborts the group instead: its peers may wait in a collective it will never
    join, which an orderly destroy could wait for."""
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d

    if getattr(sys, "last_value", None) is not None and hasattr(distributed_c10d, "_abort_process_group"):
        try:
            distributed_c10d._abort_process_group()
            return
        except Exception:  # noqa: BLE001 - a backend without abort (gloo): destroy it as usual
            pass
    dist.destroy_process_group()


def local_process_device(device: torch.device) -> torch.device:
    """One GPU per rank (``LOCAL_RANK``) when ``device`` names CUDA without an index; CPU stays CPU."""
    if device.type != "cuda" or device.index is not None:
        return device
    local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(local)
    return local


def check_shardable(config: PretrainedConfig, size: int) -> None:
    """Raise when ``config``'s attention or MLP cannot be split ``size`` ways (checked before any weight loads)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    problems = []
    if heads % size:
        problems.append(f"{heads} attention heads are not divisible by {size}")
    if kv_heads % size and size % kv_heads:
        problems.append(f"{kv_heads} KV heads neither divide nor are divisible by {size}")
    for field in ("intermediate_size", "moe_intermediate_size"):  # dense layers; each expert (shared ones too)
        value = getattr(config, field, None)
        if value and value % size:
            problems.append(f"{field} {value} is not divisible by {size}")
    if problems:
        raise ValueError(f"tensor_parallel_size={size} does not fit this target: " + "; ".join(problems))


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of ``x`` over the group (after a row-parallel GEMM). Same shape. A decoding step's rows go through
    tllm_spec's Lamport kernel (:mod:`.lamport`), other small inputs of a group with symmetric memory through
    torch's one-shot kernel (:mod:`.symmetric`), the rest through the process group."""
    if lamport.buffers_for(x, group_name) is not None:
        return all_reduce_add_norm(x, None, None, 0.0, group_name)[0]
    buffer = symmetric.one_shot_buffer(x, group_name)
    if buffer is not None:
        return symmetric.one_shot_all_reduce(buffer, x, group_name)
    return _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group_name))


def all_reduce_add_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                            group_name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference: (h = sum of ``x`` over the group + ``residual``, RMSNorm(h) * ``weight`` or None without a
    weight). x, residual [T, H]; weight [H]."""
    h = all_reduce(x, group_name)
    if residual is not None:
        h = residual + h
    return h, None if weight is None else rms_norm_ref(h, weight, eps)


def all_reduce_add_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                        group_name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h = sum of ``x`` over the group + ``residual``, RMSNorm(h) * ``weight``, or None without a weight): one
    kernel where the Lamport kernel takes x (:mod:`.lamport`, a weight and residual of x's dtype), else
    :func:`all_reduce` and the add and the norm as torch ops (:func:`all_reduce_add_norm_ref`)."""
    buffers = lamport.buffers_for(x, group_name)
    fits = ((residual is None or residual.dtype == x.dtype and residual.shape == x.shape and residual.is_contiguous())
            and (weight is None or weight.dtype == x.dtype and weight.is_contiguous()))
    if buffers is None or not fits:  # the reference's ops, its norm the norm kernel (a weight of another dtype:
        h = all_reduce_add_norm_ref(x, residual, None, eps, group_name)[0]  # the reference's promotion)
        norm = torch.ops.tllm_spec.rms_norm if torch.compiler.is_compiling() else rms_norm
        return h, None if weight is None else norm(h, weight, eps)
    if torch.compiler.is_compiling():  # opaque to Inductor (the op's own code runs when the graph does)
        out, normed = torch.ops.tllm_spec.lamport_all_reduce(x, residual, weight, eps, group_name)
        return out, normed if weight is not None else None
    return lamport.all_reduce_add_norm(x, residual, weight, eps, buffers)


def gather_vocab(logits: torch.Tensor, vocab_size: int, parallel: TensorParallel) -> torch.Tensor:
    """Vocabulary-parallel logits [R, V/size] of every rank -> full logits [R, vocab_size] on every rank."""
    parts = _c10d.wait_tensor(_c10d.all_gather_into_tensor(logits.contiguous(), parallel.size,
                                                           parallel.group_name))  # [size*R, V/size]
    rows = logits.shape[0]
    return parts.view(parallel.size, rows, -1).transpose(0, 1).reshape(rows, -1)[:, :vocab_size]


def min_over_ranks(value: int, parallel: TensorParallel, device: torch.device) -> int:
    """The smallest ``value`` of all ranks, on every rank: one answer for a load-time choice that each rank would
    make from its own state (a collective itself; ``device``: a CUDA one for NCCL)."""
    vote = torch.tensor([value], dtype=torch.int64, device=device)
    return int(_c10d.wait_tensor(_c10d.all_reduce(vote, "min", parallel.group_name)).item())


def all_ranks_agree(flag: bool, parallel: TensorParallel, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank (:func:`min_over_ranks`): for a load-time choice that decides which
    collectives the steps run."""
    return bool(min_over_ranks(int(flag), parallel, device))


def broadcast_from_first(x: torch.Tensor, parallel: TensorParallel) -> torch.Tensor:
    """Rank 0's ``x`` on every rank."""
    return _c10d.wait_tensor(_c10d.broadcast(x, 0, parallel.group_name))
