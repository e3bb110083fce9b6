"""TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS: force how many drafts each generation request accepts.

A debugging and benchmarking knob (TensorRT-LLM's): the value is the number of accepted *draft* tokens per
step (the bonus token not counted), capped at K. A fractional part is the probability of accepting one
more, drawn from device-resident counter-based state so it works inside a CUDA graph. This is the only
environment variable that changes tllm_spec's behaviour, and this module is the only place that reads it.
"""
from __future__ import annotations

import math
import os
import warnings

import torch

from . import rng

ENV_VAR = "TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS"
_SALT = 0x5EED  # a stream of its own, apart from sampling's


def read_forced_num_accepted(environ: dict[str, str] | None = None) -> float | None:
    """The forced number of accepted drafts, or None when the variable is unset or empty.

    An unparsable or negative value warns and means 0 (every draft rejected).
    """
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        warnings.warn(f"{ENV_VAR}={raw!r} is not a non-negative number; forcing 0 accepted drafts", stacklevel=2)
        return 0.0
    return value


def forced_num_accepted(forced: float, max_draft_len: int, num_rows: int, seed: torch.Tensor,
                        offset: torch.Tensor) -> torch.Tensor:
    """Accepted tokens per generation request under forcing: 1 + min(K, floor(v) + [u < frac(v)]).

    seed, offset: [1] int64 device tensors. Returns [num_rows] int64 (bonus token included).
    """
    whole, frac = math.floor(forced), forced - math.floor(forced)
    extra = (rng.uniform(seed, offset, (num_rows,), salt=_SALT) < frac).to(torch.int64)
    return (extra + whole).clamp_(max=max_draft_len) + 1
