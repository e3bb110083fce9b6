"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decoding step.

A dependent kernel is scheduled while the kernel before it still runs. It first does work that reads nothing
that kernel writes (the attention asks L2 for cached K/V it will read: :func:`prefetch_l2`), then waits for the
kernel's results (``gdc_wait``) and at once lets the next kernel launch. Within a CUDA graph this hides most of
the gap between consecutive kernels of a one-request step, and fills the memory system while small kernels
(norms, attention over a short context) run. Every kernel launched this way waits before it writes anything
or reads what the kernel in front may write, so it never overlaps more than its predecessor's tail; a prefetch only
moves data into L2. The paged attention also reads the step's positions before its wait (a split a run does not use
exits there): no step writes positions in the kernel right before an attention (a chain's positions feed the
rotary embedding in front of it; a draft tree's attention follows its own KV-write kernel).

``TLLM_SPEC_DEPENDENT_LAUNCH=0`` launches every kernel plainly: for a profile whose kernel times are each kernel's
own (with PDL a dependent's time includes its wait on the kernel in front), or to rule PDL out while debugging.
Read at each launch (a CUDA graph keeps the launches it captured); the results are the same bits either way.
"""
from __future__ import annotations

import os

import torch

from . import runs_kernel

try:  # triton is a GPU extra: the package imports and runs without it
    import triton
    import triton.language as tl
    import triton.language.extra.cuda  # noqa: F401  (gdc_wait / gdc_launch_dependents, where this triton has them)
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None


DEPENDENT_LAUNCH_VAR = "TLLM_SPEC_DEPENDENT_LAUNCH"


def launches_dependent(t: torch.Tensor) -> bool:
    """Whether kernels for tensors like ``t`` launch as programmatic dependents: CUDA on Hopper or later, with a
    triton that has ``gdc_wait`` (never under the interpreter), unless ``TLLM_SPEC_DEPENDENT_LAUNCH`` is "0"."""
    return (t.is_cuda and runs_kernel(t) and os.environ.get(DEPENDENT_LAUNCH_VAR, "1").strip() != "0"
            and hasattr(triton.language.extra.cuda, "gdc_wait")
            and torch.cuda.get_device_capability(t.device)[0] >= 9)


def launch_options(pdl: bool) -> dict[str, bool]:
    """The launch keyword for :func:`launches_dependent` kernels (none otherwise)."""
    return {"launch_pdl": True} if pdl else {}


if triton is not None:

    @triton.jit
    def prefetch_l2(ptrs, mask):
        """Ask L2 for the 128-byte lines at ``ptrs`` (where ``mask``); nothing is waited for or returned."""
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                                  "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def wait_and_release():
        """Wait for the kernel before (its results are visible after this), then let the next kernel launch."""
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
