"""Counter-based random numbers from device-resident (seed, offset) tensors.

Every draw is a pure function of (seed, offset, salt, element index), so it needs no host RNG state,
works inside a CUDA graph (the tensors are read on the device) and is identical on CPU and GPU.

Two layouts: ``seed``/``offset`` of shape [1] make one stream over the whole draw (element index = flat
index; the batch stream); of shape [R] (R = ``shape[0]``) one stream per row (element index = index within
the row), so a row's numbers do not depend on which other rows are drawn with it — what per-request seeds
need. With one row the two coincide.
"""
from __future__ import annotations

import torch

from ..kernels import uniform as uniform_kernel

_SEED_MODULUS = 2**31


def uniform(seed: torch.Tensor, offset: torch.Tensor, shape: tuple[int, ...], salt: int = 0) -> torch.Tensor:
    """Uniform floats in (0, 1), float32, of ``shape``, on ``seed``'s device.

    seed, offset: [1] int64 (one stream) or [shape[0]] int64 (one stream per row), device tensors.
    ``salt`` separates independent streams of one step. Inside torch.compile the draw is one opaque op:
    Inductor would fold the hash's 32-bit multipliers into int32 index arithmetic, which overflows. On CUDA the
    hash is one kernel launch (:mod:`tllm_spec.kernels.uniform`), whose numbers are the CPU reference's.
    """
    if torch.compiler.is_compiling():
        return torch.ops.tllm_spec.uniform(seed, offset, list(shape), salt)
    return uniform_kernel.uniform(seed, offset, tuple(shape), salt)


@torch.library.custom_op("tllm_spec::uniform", mutates_args=())
def _uniform_op(seed: torch.Tensor, offset: torch.Tensor, shape: list[int], salt: int) -> torch.Tensor:
    return uniform_kernel.uniform(seed, offset, tuple(shape), salt)


@_uniform_op.register_fake
def _(seed, offset, shape, salt):
    return seed.new_empty(shape, dtype=torch.float32)


def advance(seed: torch.Tensor) -> None:
    """Move to a fresh stream in place (graph-safe): seed <- (seed + 1) mod 2**31."""
    seed.add_(1).remainder_(_SEED_MODULUS)
