"""One-shot all-reduce over peer-to-peer symmetric memory, for the step's small all-reduces.

A decoding step all-reduces [T, H] after every row-parallel GEMM: 64 of them a step for an 8B target, a few KB
each at batch 1, where NCCL's latency (10-20 us inside a CUDA graph) rather than its bandwidth sets the time. With
torch's symmetric memory every rank maps its peers' buffer of one allocation (``symm_mem.empty`` + ``rendezvous``,
peer-to-peer over NVLink); ``torch.ops.symm_mem.one_shot_all_reduce_copy`` copies a rank's input into its buffer,
meets its peers at a barrier on the signal pads and sums every rank's buffer by direct loads: one kernel, no
proxy thread. It uses no NVLink multicast and no ``multimem`` operation (the machines keep them off:
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``). Inputs above ``MAX_ONE_SHOT_BYTES`` (prompt chunks, large batches), other
dtypes and CPU groups keep NCCL / gloo (:func:`tllm_spec.distributed.parallel.all_reduce`).

Measured on 2 H100s (torch 2.11; 64 chained all-reduces of [T, 4096] bf16 replayed in one CUDA graph): 9.9-10.3 us
each one-shot against 12.7-13.1 us through NCCL at T = 1, 4 and 16. The 8B shape's TP-2 step at batch 1: 3.97 ms
without speculation and 5.33 ms with EAGLE-3 3 of 3, against 4.30 and 5.58-5.74 ms through NCCL on another machine
of the same kind (docs/benchmarks/README.md).
"""
from __future__ import annotations

import logging
import warnings

import torch

log = logging.getLogger("tllm_spec.distributed")
MAX_ONE_SHOT_BYTES = 512 * 1024  # one-shot reads every peer's whole input: for small messages only
# (group name, dtype) -> this rank's symmetric buffer; set on every rank of a group together (rendezvous)
_buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def enable(group_name: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Allocate and exchange this rank's buffer for ``dtype`` over the group (a collective: every rank calls it
    with the same arguments). False, with a log line, where this torch or machine cannot (the all-reduces then
    stay on NCCL)."""
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
        buffer = symm_mem.empty(MAX_ONE_SHOT_BYTES // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group_name)
    except Exception as err:  # noqa: BLE001 - whatever the platform refuses, NCCL still works
        log.warning("one-shot all-reduce over symmetric memory unavailable (%s: %s); all-reduces stay on NCCL",
                    type(err).__name__, err)
        return False
    _buffers[group_name, dtype] = buffer
    return True


def one_shot_buffer(x: torch.Tensor, group_name: str) -> torch.Tensor | None:
    """This rank's symmetric buffer for ``x`` when the one-shot all-reduce takes it, else None."""
    buffer = _buffers.get((group_name, x.dtype))
    return buffer if buffer is not None and x.numel() <= buffer.numel() else None


def one_shot_all_reduce(buffer: torch.Tensor, x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of ``x`` over the group through ``buffer`` (:func:`one_shot_buffer`). Same shape."""
    x = x.contiguous()
    return torch.ops.symm_mem.one_shot_all_reduce_copy(buffer[:x.numel()].view(x.shape), x, "sum", group_name)
