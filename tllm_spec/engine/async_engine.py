"""AsyncEngine: the engine loop from asyncio — ``async for out in engine.generate(prompt, params, request_id)``.
The event loop only exchanges messages with the engine thread; a consumer that stops early (a client that
disconnects, a cancelled task) aborts its request, whose pages are freed at the next step boundary.

At high concurrency the event loop's Python (one server-sent event per request per step) shares the interpreter
with the engine thread, so the hand-over is batched: a step's outputs for one event loop wake it once, and a
consumer that fell behind takes every output queued for it as one (fewer, larger chunks; the same tokens)."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from ..config import SamplingParams
from .cuda_graphs import num_compiled_graphs
from .loop import Announcement, EngineLoop
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
    num_cuda_graphs: int = 0  # captured CUDA graphs
    num_compiled_graphs: int = 0  # graphs torch.compile has compiled in this process
    num_evictable_kv_pages: int = 0  # cached prefix pages no request holds (counted in num_free_kv_pages)
    num_used_kv_pages: int = 0  # pages requests hold: num_free_kv_pages + this = the pool (num_kv_pages - 1)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of those, tokens found cached


class AsyncEngine:
    """The asyncio side of an :class:`EngineLoop` (``SpecModel.async_engine``)."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self._mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}
        self._lock = threading.Lock()

    def _mailbox(self, event_loop: asyncio.AbstractEventLoop) -> _Mailbox:
        with self._lock:
            if event_loop not in self._mailboxes:
                self._mailboxes = {lp: box for lp, box in self._mailboxes.items() if not lp.is_closed()}
                self._mailboxes[event_loop] = _Mailbox(event_loop)
            return self._mailboxes[event_loop]

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
        mailbox = self._mailbox(asyncio.get_running_loop())
        settle_announcement()  # before the engine can take it: it never counts a request both on its way and queued
        request_id = self.loop.submit(ids, as_params(params if params is not None else SamplingParams()),
                                      lambda out: mailbox.put(outputs, out), request_id)
        finished = False
        try:
            while not finished:
                queued = [await outputs.get()]
                while not outputs.empty():
                    queued.append(outputs.get_nowait())
                out = StreamOutput.merged(queued)
                finished = out.finished
                if out.exception is not None:
                    raise out.exception
                yield out
        finally:
            if not finished:
                self.loop.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt page (between steps; PrefixCache.reset)."""
        self.loop.call(self.loop.engine.prefix_cache.reset)

    def state(self) -> EngineState:
        engine = self.loop.engine
        graphs, pages, cache = engine.runner.graph_runner, engine.kv.pages, engine.prefix_cache
        return EngineState(len(engine.running), len(engine.waiting), engine.kv.num_free_pages,
                           engine.runner.num_kv_pages, engine.runner.max_batch_size,
                           len(graphs.graphs) if graphs is not None else 0, num_compiled_graphs(),
                           pages.num_evictable, pages.num_in_use, cache.queries, cache.hits)


_ANNOUNCEMENT: contextvars.ContextVar[Announcement | None] = contextvars.ContextVar("tllm_spec_announcement",
                                                                                    default=None)


@contextlib.contextmanager
def announced(loop: EngineLoop) -> Iterator[None]:
    """The request handled inside this block is announced to the engine (:meth:`EngineLoop.announce`) until
    :meth:`AsyncEngine.generate` submits it, or until the block ends (a refused request)."""
    announcement = loop.announce()
    token = _ANNOUNCEMENT.set(announcement)
    try:
        yield
    finally:
        announcement.settle()
        _ANNOUNCEMENT.reset(token)


def settle_announcement() -> None:
    announcement = _ANNOUNCEMENT.get()
    if announcement is not None:
        announcement.settle()


class _Mailbox:
    """Outputs from the engine thread to one event loop: the first output since the last hand-over schedules one
    callback that moves everything gathered meanwhile into the consumers' queues (one wake-up per step, not one
    per request)."""

    def __init__(self, event_loop: asyncio.AbstractEventLoop):
        self.event_loop = event_loop
        self._items: list[tuple[asyncio.Queue, StreamOutput]] = []
        self._lock = threading.Lock()

    def put(self, queue: asyncio.Queue, out: StreamOutput) -> None:
        """Engine thread."""
        with self._lock:
            self._items.append((queue, out))
            if len(self._items) > 1:
                return  # a hand-over is already scheduled
        try:
            self.event_loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:  # the loop is closed: nobody will read these outputs
            with self._lock:
                self._items.clear()
            raise

    def _hand_over(self) -> None:
        """Event loop."""
        with self._lock:
            items, self._items = self._items, []
        for queue, out in items:
            queue.put_nowait(out)
