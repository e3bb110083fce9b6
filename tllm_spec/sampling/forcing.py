"""TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS: force how many drafts each generation request accepts.

A debugging and benchmarking knob, read as TensorRT-LLM reads it: the value is the number of accepted *draft*
tokens per generation request and step (the bonus token not counted), capped at K; unset, empty, ``0`` or an
unparsable value mean "off" (strict / rejection acceptance decides), and an unparsable value warns. Negative and
non-finite values are unparsable here (TensorRT-LLM would take them and misbehave). The accepted rows still
hold the target's tokens: forcing changes how many rows count, never what they contain.

Fractional values: the integer part is always accepted and the fractional part is the probability of accepting
one more draft. TensorRT-LLM's recent one-model path reads fractions the same way (its two-model path and older
revisions take integers only); our draws come from the device-resident counter-based stream of :mod:`rng`
(seeded by the generate call, CUDA-graph safe) rather than TensorRT-LLM's fixed-seed lookup pool, so the
individual draws differ. The lottery draws from the generate call's batch stream, also for requests with
their own ``SamplingParams.seed``. This is the only environment variable that changes tllm_spec's behaviour,
and this module is the only place that reads it.
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
    """The forced number of accepted drafts, or None (off) when the variable is unset, empty or 0.

    An unparsable, negative or non-finite value warns and means off.
    """
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        warnings.warn(f"{ENV_VAR}={raw!r} is not a non-negative number; forced acceptance is off", stacklevel=2)
        return None
    return value or None


def forced_num_accepted(forced: float | torch.Tensor, max_draft_len: int, num_rows: int, seed: torch.Tensor,
                        offset: torch.Tensor) -> torch.Tensor:
    """Accepted tokens per generation request under forcing: 1 + min(K, floor(v) + [u < frac(v)]).

    forced: v, a float or a 0-dim float64 tensor on seed's device (what a graphed step reads, so a new value
    needs no recompilation). seed, offset: [1] int64 device tensors, the batch stream; the seed is advanced in
    place after the draw (an all-greedy step samples nothing else, and the next step's lottery must not repeat
    this one's). Returns [num_rows] int64 (bonus token included).
    """
    forced = torch.as_tensor(forced, dtype=torch.float64, device=seed.device)
    whole = forced.floor()
    extra = (rng.uniform(seed, offset, (num_rows,), salt=_SALT) < (forced - whole).float()).to(torch.int64)
    rng.advance(seed)
    return (extra + whole.to(torch.int64)).clamp_(max=max_draft_len) + 1
