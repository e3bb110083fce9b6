"""AsyncEngine: the engine loop from asyncio — ``async for out in engine.generate(prompt, params, request_id)``.
The event loop only exchanges messages with the engine thread; a consumer that stops early (a client that
disconnects, a cancelled task) aborts its request, whose pages are freed at the next step boundary."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..config import SamplingParams
from .loop import EngineLoop
from .request import StreamOutput
from .streams import as_params, check_prompt


@dataclass(frozen=True)
class EngineState:
    """What the engine holds right now (read between steps, from any thread)."""

    num_running: int
    num_waiting: int
    num_free_kv_pages: int
    num_kv_pages: int
    max_batch_size: int


class AsyncEngine:
    """The asyncio side of an :class:`EngineLoop` (``SpecModel.async_engine``)."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop

    @property
    def tokenizer(self):
        return self.loop.engine.tokenizer

    def decode_each(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (logprobs' token strings); any thread."""
        return self.loop.engine.decode_each(token_ids)

    def check(self, prompt: str | list[int], params: SamplingParams | dict | None) -> tuple[list[int] | None,
                                                                                           str | None]:
        """(token ids, None), or (None, why the request would be refused)."""
        return check_prompt(self.loop, prompt, params if params is not None else SamplingParams())

    async def generate(self, prompt: str | list[int], params: SamplingParams | dict | None = None,
                       request_id: str | None = None) -> AsyncIterator[StreamOutput]:
        """The request's StreamOutputs as its steps complete; the last has ``finished`` and ``output``. Raises
        ValueError for a refused request, and a failed step's exception."""
        ids, error = self.check(prompt, params)
        if error:
            raise ValueError(error)
        outputs: asyncio.Queue[StreamOutput] = asyncio.Queue()
        event_loop = asyncio.get_running_loop()
        request_id = self.loop.submit(ids, as_params(params if params is not None else SamplingParams()),
                                      lambda out: event_loop.call_soon_threadsafe(outputs.put_nowait, out),
                                      request_id)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                if out.exception is not None:
                    raise out.exception
                yield out
        finally:
            if not finished:
                self.loop.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def state(self) -> EngineState:
        engine = self.loop.engine
        return EngineState(len(engine.running), len(engine.waiting), engine.kv.num_free_pages,
                           engine.runner.num_kv_pages, engine.runner.max_batch_size)
