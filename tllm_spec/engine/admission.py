"""When waiting requests join the batch. A step's prompt chunks run without a CUDA graph (beside the decoders'
graph, :meth:`ModelRunner.step`), mostly host time, so requests that arrive close together should share one
prefill step: while requests decode, a new one waits up to ``scheduler_delay_factor`` times the last prefill step
(each prefill step costs the running streams a step); while nothing decodes, waiting requests start once none has
arrived for ``admission_window_ms`` and none is announced (a server reading it, :meth:`EngineLoop.announce`), at
most ADMISSION_WINDOW_CAP windows after the first; and always at once when they fill every free slot."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ..config import ADMISSION_WINDOW_CAP, EngineConfig
from .request import Request


class AdmissionPolicy:
    """The engine's admission timing (its thread only). ``clock`` stamps arrivals (tests replace it);
    ``prefill_seconds`` is the last step with prompt tokens, launch to outputs read (the engine records it);
    ``num_incoming`` counts the requests announced and not yet submitted (the engine loop sets it)."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.perf_counter):
        self.delay_factor = config.scheduler_delay_factor
        self.window = config.admission_window_ms / 1e3
        self.max_batch_size = config.max_batch_size
        self.clock = clock
        self.prefill_seconds = 0.0
        self.num_incoming: Callable[[], int] = lambda: 0

    def due(self, waiting: Sequence[Request], running: Sequence[Request]) -> bool:
        """Whether the waiting requests may join now (see the module docstring)."""
        if len(waiting) >= self.max_batch_size - len(running):
            return True
        if not running:
            return self.idle_wait(waiting, running) == 0.0
        return self.clock() - waiting[0].arrival >= self.delay_factor * self.prefill_seconds

    def idle_wait(self, waiting: Sequence[Request], running: Sequence[Request]) -> float:
        """Seconds the engine's thread may sleep before waiting requests start, while nothing decodes (0: now):
        until none has arrived for the window and none is announced, at most ADMISSION_WINDOW_CAP windows after
        the first arrival."""
        if running or not waiting or len(waiting) >= self.max_batch_size:
            return 0.0
        now = self.clock()
        quiet = waiting[-1].arrival + self.window - now
        if self.num_incoming() > 0:
            quiet = max(quiet, self.window)  # look again after a window (or when a message comes)
        cap = waiting[0].arrival + ADMISSION_WINDOW_CAP * self.window - now
        return max(0.0, min(quiet, cap))
