"""Kernels: one op per file, each with a torch reference of the same signature (the CPU path)."""
from __future__ import annotations

import torch

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None


def runs_kernel(t: torch.Tensor) -> bool:
    """Whether a launcher takes its Triton kernel for tensors like ``t`` (CUDA, triton installed); otherwise
    the torch reference. (Tests patch this to run the kernels under Triton's CPU interpreter.)"""
    return triton is not None and t.is_cuda

