"""The step's all-reduce as one push-and-poll kernel over peer-to-peer memory, with the residual add and the next
RMSNorm in the same kernel.

A tensor-parallel decoding step all-reduces a few KB after every row-parallel GEMM (64 times a step for an 8B
target), so the collective's latency sets its cost. torch's one-shot all-reduce over symmetric memory meets its
peers at two barriers a call (:mod:`.symmetric`); this kernel needs none. Every rank owns a buffer that all ranks
map (torch's symmetric memory, peer-to-peer over NVLink; no multicast, no ``multimem``), two halves of ``world``
slots each, every element initialised to negative zero. A call:

1. writes this rank's rows into its slot of every peer's buffer (plain stores over NVLink; a negative zero among
   them is written as a positive one, so no value looks like an empty element),
2. polls its own buffer (volatile loads) until no element of a peer's slot is negative zero, then sums the slots in
   rank order in fp32, which gives every rank the same bits,
3. writes negative zero back over what it read, for the call after next,
4. adds the residual and applies the RMSNorm as :mod:`tllm_spec.kernels.rms_norm` does, rounding where the stock
   ops round.

Consecutive calls alternate halves (a parity in this rank's device memory, flipped by the last program to finish),
so a peer that has run ahead into the next call writes into the other half; it cannot run two calls ahead, since
the call after this one needs this rank's rows. Nothing waits on the host, so a CUDA graph replays it.
Lamport's clock is the idea (TensorRT-LLM's one-shot all-reduce uses it with a negative-zero sentinel too).

:func:`tllm_spec.distributed.parallel.all_reduce_add_norm_ref` is the reference: the process group's all-reduce,
the add and the norm as three ops (the CPU path, and every input the kernel does not take).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import dependent_launch, runs_kernel

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

SLOT_BYTES = 512 * 1024  # one rank's rows of one call: a decoding step's [T, H] (T * H * 2 bytes)
MAX_WIDTH = 16384  # a program holds a row
MAX_PROGRAMS = 128  # every program is resident at once on an H100/H200 (they poll for each other's peers)
NEGATIVE_ZERO = -32768  # the bits of -0.0 in bf16 and fp16, as int16 (an empty element)


@dataclass(frozen=True)
class LamportBuffers:
    """One rank's view of a group's buffers for one dtype: ``buffer`` (this rank's, [2, world, slot]),
    ``peers`` (every rank's buffer address, int64 on the device), ``flags`` ([parity, programs finished])."""

    buffer: torch.Tensor
    peers: torch.Tensor
    flags: torch.Tensor
    rank: int
    world: int

    @classmethod
    def local(cls, buffer: torch.Tensor, addresses: list[int], rank: int) -> LamportBuffers:
        """Buffers of this rank given every rank's buffer address; ``buffer`` is set to empty (negative zero)."""
        world = len(addresses)
        if buffer.numel() < buffer_elements(buffer.dtype, world):
            raise ValueError(f"a Lamport buffer of {world} ranks needs {buffer_elements(buffer.dtype, world)} "
                             f"elements, got {buffer.numel()}")
        buffer.view(torch.int16).fill_(NEGATIVE_ZERO)
        peers = torch.tensor(addresses, dtype=torch.int64, device=buffer.device)
        return cls(buffer, peers, torch.zeros(2, dtype=torch.int32, device=buffer.device), rank, world)


# (group name, dtype) -> this rank's buffers (.symmetric.enable sets them, on every rank of the group together)
_registry: dict[tuple[str, torch.dtype], LamportBuffers] = {}


def register(group_name: str, buffers: LamportBuffers) -> None:
    _registry[group_name, buffers.buffer.dtype] = buffers


def buffers_for(x: torch.Tensor, group_name: str) -> LamportBuffers | None:
    """The group's buffers when the kernel :func:`takes` ``x``, else None."""
    buffers = _registry.get((group_name, x.dtype))
    return buffers if takes(x, buffers) else None


def slot_elements(dtype: torch.dtype) -> int:
    return SLOT_BYTES // dtype.itemsize


def buffer_elements(dtype: torch.dtype, world: int) -> int:
    """Elements of one rank's buffer for ``world`` ranks."""
    return 2 * world * slot_elements(dtype)


def takes(x: torch.Tensor, buffers: LamportBuffers | None) -> bool:
    """Whether the kernel all-reduces ``x`` [T, H] through ``buffers``: bf16/fp16 rows of the buffer's dtype on
    CUDA, contiguous, at most ``MAX_WIDTH`` wide, one slot in all."""
    return (buffers is not None and runs_kernel(x) and x.dim() == 2 and x.dtype == buffers.buffer.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and x.is_contiguous() and x.shape[1] <= MAX_WIDTH
            and x.numel() <= slot_elements(x.dtype))


def all_reduce_add_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                        buffers: LamportBuffers) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~tllm_spec.distributed.parallel.all_reduce_add_norm_ref` through the kernel, for inputs it
    :func:`takes` (a weight and residual of x's dtype and shape). Every rank of the group calls it with the same
    shapes, in the same order."""
    out = torch.empty_like(x)
    normed = torch.empty_like(x) if weight is not None else None
    _launch(x, residual, weight, eps, buffers, out, normed, warmup=False)
    return out, normed


def load(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
         buffers: LamportBuffers) -> None:
    """Compile and load the kernel :func:`all_reduce_add_norm` would launch for these inputs, without running it.
    Several ranks' kernels side by side on one GPU (tests) need it: loading a module waits for the running kernels,
    and a rank's running kernel waits for its peers."""
    _launch(x, residual, weight, eps, buffers, x, None, warmup=True)._init_handles()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
            buffers: LamportBuffers, out: torch.Tensor, normed: torch.Tensor | None, warmup: bool):
    rows, width = x.shape
    block = triton.next_power_of_2(width)
    pdl = dependent_launch.launches_dependent(x)
    args = (x, x if residual is None else residual, x if weight is None else weight, out,
            out if normed is None else normed, buffers.buffer, buffers.peers, buffers.flags, rows, width, eps,
            slot_elements(x.dtype))
    options = dict(RANK=buffers.rank, WORLD=buffers.world, BLOCK=block, RESIDUAL=residual is not None,
                   NORM=weight is not None, PDL=pdl, num_warps=min(16, max(1, block // 512)),
                   **dependent_launch.launch_options(pdl))
    grid = (min(rows, MAX_PROGRAMS),)
    return _lamport_kernel.warmup(*args, grid=grid, **options) if warmup else _lamport_kernel[grid](*args, **options)


@torch.library.custom_op("tllm_spec::lamport_all_reduce", mutates_args=())
def lamport_all_reduce_op(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                          group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`all_reduce_add_norm` over the group's registered buffers as a torch op (opaque to torch.compile);
    without a weight the second output is empty."""
    out, normed = all_reduce_add_norm(x, residual, weight, eps, _registry[group_name, x.dtype])
    return out, x.new_empty(0) if normed is None else normed


@lamport_all_reduce_op.register_fake
def _(x, residual, weight, eps, group_name):
    return torch.empty_like(x), x.new_empty(0) if weight is None else torch.empty_like(x)


if triton is not None:
    from ..kernels.dependent_launch import wait_and_release
    from ..kernels.rms_norm import normed_row

    _EMPTY = tl.constexpr(NEGATIVE_ZERO)

    @triton.jit
    def _lamport_kernel(x_ptr, r_ptr, w_ptr, out_ptr, n_ptr, buf_ptr, peers_ptr, flags_ptr, T, H, eps, SLOT,
                        RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr,
                        NORM: tl.constexpr, PDL: tl.constexpr):
        """Rows pid, pid + programs, ...: push to the peers, poll this rank's slots, sum, clear, add, norm; the
        last program to finish flips the parity (module docstring)."""
        if PDL:
            wait_and_release()
        dtype = x_ptr.dtype.element_ty
        parity = tl.load(flags_ptr, volatile=True)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        empty = tl.full([BLOCK], _EMPTY, tl.int16).to(dtype, bitcast=True)
        for row in range(tl.program_id(0), T, tl.num_programs(0)):
            x = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0)
            x = tl.where(x == 0.0, tl.zeros_like(x), x)  # -0.0 is the empty mark
            for i in tl.static_range(1, WORLD):
                peer = tl.load(peers_ptr + (RANK + i) % WORLD).to(tl.pointer_type(dtype))
                tl.store(peer + (parity * WORLD + RANK) * SLOT + row * H + cols, x, mask=ok)
            acc = tl.zeros([BLOCK], tl.float32)
            for src in tl.static_range(WORLD):
                if src == RANK:
                    acc += x.to(tl.float32)
                else:
                    ptrs = buf_ptr + (parity * WORLD + src) * SLOT + row * H + cols
                    v = tl.load(ptrs, mask=ok, other=0.0, volatile=True)
                    waiting = tl.max(((v.to(tl.int16, bitcast=True) == _EMPTY) & ok).to(tl.int32), 0)
                    while waiting > 0:
                        v = tl.load(ptrs, mask=ok, other=0.0, volatile=True)
                        waiting = tl.max(((v.to(tl.int16, bitcast=True) == _EMPTY) & ok).to(tl.int32), 0)
                    tl.store(ptrs, empty, mask=ok)
                    acc += v.to(tl.float32)
            h = acc.to(dtype)  # the all-reduced partial sums, rounded once as the process group's sum is
            if RESIDUAL:
                h = (tl.load(r_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32) + h.to(tl.float32)).to(dtype)
            tl.store(out_ptr + row * H + cols, h, mask=ok)
            if NORM:
                tl.store(n_ptr + row * H + cols, normed_row(h.to(tl.float32), w_ptr, cols, ok, H, eps), mask=ok)
        finished = tl.atomic_add(flags_ptr + 1, 1)
        if finished == tl.num_programs(0) - 1:  # every program has read the parity: the next call takes the other half
            tl.store(flags_ptr + 1, 0)
            tl.store(flags_ptr, 1 - parity)
