"""Peer-to-peer symmetric memory for the step's small all-reduces: torch's one-shot kernel, and the buffers of
tllm_spec's Lamport kernel (:mod:`.lamport`).

A decoding step all-reduces [T, H] after every row-parallel GEMM: 64 of them a step for an 8B target, a few KB
each at batch 1, where NCCL's latency (10-20 us inside a CUDA graph) rather than its bandwidth sets the time. With
torch's symmetric memory every rank maps its peers' buffer of one allocation (``rendezvous``, peer-to-peer over
NVLink); ``torch.ops.symm_mem.one_shot_all_reduce_copy`` copies a rank's input into its buffer, meets its peers at
a barrier on the signal pads, sums every rank's buffer by direct loads and meets them again. It uses no NVLink
multicast and no ``multimem`` operation (the machines keep them off: ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``), and
neither does the Lamport kernel, which needs no barrier. Inputs above ``MAX_ONE_SHOT_BYTES`` (prompt chunks, large
batches), other dtypes and CPU groups keep NCCL / gloo (:func:`tllm_spec.distributed.parallel.all_reduce`).

Measured on 2 H100s (torch 2.11; 64 chained calls of [T, 4096] bf16, each with the residual add and the RMSNorm
after it, replayed in one CUDA graph; ``scripts/bench_all_reduce.py``): NCCL 14.2-15.0 us a call, torch's one-shot
11.6-12.7 us, the Lamport kernel 5.9-7.3 us for the sum alone and 3.8-5.0 us with the add and the norm in it
(T = 1, 4, 16). The 8B shape's TP-2 step at batch 1 (docs/benchmarks/h100x2-tensor-parallel-8b): 3.47 ms without
speculation through the Lamport kernel, 3.96 ms through torch's one-shot kernel, against 5.70 ms on one GPU.
"""
from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

from . import lamport

log = logging.getLogger("tllm_spec.distributed")
MAX_ONE_SHOT_BYTES = 512 * 1024  # one-shot reads every peer's whole input: for small messages only
# (group name, dtype) -> this rank's symmetric buffer; set on every rank of a group together (rendezvous)
_buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def enable(group_name: str, dtype: torch.dtype, device: torch.device, kernel: str = "auto") -> bool:
    """Allocate and exchange this rank's buffers for ``dtype`` over the group (a collective: every rank calls it
    with the same arguments): torch's one-shot buffer and, for ``kernel`` "auto", tllm_spec's Lamport kernel's
    (:mod:`.lamport`). False, with a log line, where this torch or machine cannot (the all-reduces then stay on
    NCCL)."""
    if (group_name, dtype) in _buffers:
        return True
    if device.type != "cuda":
        return False
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
            raise RuntimeError("this torch has no symm_mem.one_shot_all_reduce_copy")
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # older torch needs it; newer warns (a no-op)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(group_name)
        buffer, _ = _allocate(symm_mem, MAX_ONE_SHOT_BYTES // dtype.itemsize, dtype, device, group_name)
    except Exception as err:  # noqa: BLE001 - whatever the platform refuses, NCCL still works
        log.warning("one-shot all-reduce over symmetric memory unavailable (%s: %s); all-reduces stay on NCCL",
                    type(err).__name__, err)
        return False
    _buffers[group_name, dtype] = buffer
    if kernel == "auto" and dtype in (torch.bfloat16, torch.float16) and lamport.triton is not None:
        buffers = None
        try:
            buffers = _lamport_buffers(symm_mem, dtype, device, group_name)
        except Exception as err:  # noqa: BLE001 - torch's one-shot kernel still works
            log.warning("Lamport all-reduce unavailable (%s: %s); small all-reduces take torch's one-shot kernel",
                        type(err).__name__, err)
        vote = torch.tensor([int(buffers is not None)], device=device)
        dist.all_reduce(vote, dist.ReduceOp.MIN, group=_group(group_name))  # all ranks take it, or none
        if vote.item():
            lamport.register(group_name, buffers)
    return True


def _allocate(symm_mem, elements: int, dtype: torch.dtype, device: torch.device, group_name: str):
    """A symmetric tensor of its own allocation (not carved from torch's pool: a peer's address is then the
    start of its tensor) and its rendezvous handle."""
    allocate = getattr(getattr(symm_mem, "_SymmetricMemory", None), "empty_strided_p2p", None)
    tensor = (allocate((elements,), (1,), dtype, device) if allocate is not None
              else symm_mem.empty(elements, dtype=dtype, device=device))
    return tensor, symm_mem.rendezvous(tensor, group_name)


def _lamport_buffers(symm_mem, dtype: torch.dtype, device: torch.device, group_name: str) -> lamport.LamportBuffers:
    """The Lamport kernel's buffers, after checking that every peer address holds that peer's buffer: each rank
    marks its first element with its rank, and reads every peer's mark through the peer's address."""
    world = dist.get_world_size()
    tensor, handle = _allocate(symm_mem, lamport.buffer_elements(dtype, world), dtype, device, group_name)
    addresses = [int(a) for a in handle.buffer_ptrs]
    if addresses[handle.rank] != tensor.data_ptr():
        raise RuntimeError("this rank's symmetric address is not its tensor's")
    marks = tensor.view(torch.int16)
    marks[0] = handle.rank
    torch.cuda.synchronize(device)
    handle.barrier()
    seen = [int(handle.get_buffer(peer, (1,), torch.int16).item()) for peer in range(world)]
    handle.barrier()
    if seen != list(range(world)):
        raise RuntimeError(f"peer buffers read ranks {seen}")
    buffers = lamport.LamportBuffers.local(tensor, addresses, handle.rank)
    torch.cuda.synchronize(device)
    handle.barrier()
    return buffers


def _group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def one_shot_buffer(x: torch.Tensor, group_name: str) -> torch.Tensor | None:
    """This rank's symmetric buffer for ``x`` when the one-shot all-reduce takes it, else None."""
    buffer = _buffers.get((group_name, x.dtype))
    return buffer if buffer is not None and x.numel() <= buffer.numel() else None


def one_shot_all_reduce(buffer: torch.Tensor, x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of ``x`` over the group through ``buffer`` (:func:`one_shot_buffer`). Same shape."""
    x = x.contiguous()
    return torch.ops.symm_mem.one_shot_all_reduce_copy(buffer[:x.numel()].view(x.shape), x, "sum", group_name)
