"""StepLog: the engine's steps one by one (when launched, when their outputs were read, prompt tokens and generation
rows), to see where a serving run's time goes: the device idle between steps, prefill steps and how arrivals split
them. Off unless set (``Engine.step_log``); recording is one append per step, on the engine's thread."""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class StepRecord:
    start: float  # launch began (time.perf_counter)
    launched: float  # launch returned
    done: float  # outputs read on the host
    prompt_tokens: int  # prompt tokens the step prefilled
    prompt_requests: int  # requests with a prompt chunk in the step
    rows: int  # requests whose outputs the step delivered (prompt chunks included)
    chained: bool  # launched ahead, before the step before it was read
    waiting: int  # requests waiting for admission once it was read


class StepLog:
    """The last ``capacity`` steps' records, oldest first."""

    def __init__(self, capacity: int = 100_000):
        self.records: deque[StepRecord] = deque(maxlen=capacity)

    def record(self, step: StepRecord) -> None:
        self.records.append(step)

    def summary(self) -> dict[str, float]:
        """Steps, prefill steps and their prompt tokens, and the span from the first launch to the last read split
        into decode-only steps, steps with prompt tokens and the time between a step's read and the next launch
        where no step was in flight (the engine's thread busy or waiting; the device idle)."""
        steps = list(self.records)
        if not steps:
            return {"steps": 0}
        prefill = [s for s in steps if s.prompt_tokens]
        idle = sum(max(0.0, b.start - a.done) for a, b in zip(steps, steps[1:]) if not b.chained)
        in_prefill = sum(s.done - s.start for s in prefill)
        span = steps[-1].done - steps[0].start
        per_prefill = max(len(prefill), 1)
        return {"steps": len(steps), "span_s": round(span, 4), "prefill_steps": len(prefill),
                "prompt_tokens_per_prefill_step": round(sum(s.prompt_tokens for s in prefill) / per_prefill, 1),
                "prompt_requests_per_prefill_step": round(sum(s.prompt_requests for s in prefill) / per_prefill, 2),
                "prefill_steps_s": round(in_prefill, 4), "idle_between_steps_s": round(idle, 4),
                "mean_rows": round(sum(s.rows for s in steps) / len(steps), 2)}

    @classmethod
    def from_dicts(cls, records: list[dict]) -> StepLog:
        """A log of records written by :meth:`as_dicts`."""
        log = cls()
        log.records.extend(StepRecord(**r) for r in records)
        return log

    def as_dicts(self) -> list[dict]:
        return [asdict(s) for s in self.records]


@dataclass
class LaunchedStep:
    """A launched step: its packed outputs on the host [B, 2K+3 (+ logprob columns)] int64 (valid once ``ready``
    has passed; None: already there), how it was launched, and the host time spent launching it."""

    host: torch.Tensor
    ready: torch.cuda.Event | None
    draft_len: int
    next_draft_len: int
    context_ends: tuple[int, ...]  # where each prompt chunk of the step ends (its first rows)
    chained: bool  # launched by run_next, before the step before it was read
    start: float
    host_seconds: float
    prompt_tokens: int = 0

    @property
    def has_context(self) -> bool:
        """A step with prompt chunks: never graphed, never timed as a decode step."""
        return bool(self.context_ends)

    def record(self, done: float, rows: int, waiting: int) -> StepRecord:
        """Its :class:`StepRecord`, its outputs read at ``done``."""
        return StepRecord(self.start, self.start + self.host_seconds, done, self.prompt_tokens,
                          len(self.context_ends), rows, self.chained, waiting)
