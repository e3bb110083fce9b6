"""EngineLoop: the one thread that owns the GPU. It drives the :class:`Engine`; every other thread (a caller of
``generate``, a stream's consumer, the server's event loop) only exchanges messages with it, so the model is
safe to use from many threads at once."""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import Callable, Sequence

import torch

from ..config import SamplingParams
from .engine import Engine
from .request import DecodeTimer, StreamOutput

log = logging.getLogger("tllm_spec.engine")

# On the CPU the engine thread runs a target this narrow on one intra-op thread (engine_threads).
ONE_THREAD_MAX_HIDDEN = 512


def engine_threads(device: torch.device, hidden_size: int, requested: int) -> int:
    """Intra-op threads of the engine thread: ``requested`` (the count of the thread that made the model), but
    one on the CPU for a target of hidden size at most ONE_THREAD_MAX_HIDDEN.

    Why: once the thread that made the model has an OpenMP team, every parallel op of a second thread wakes a
    team of its own from sleep (libgomp stops spinning when it manages more threads than there are cores): about
    80 us a region on 2 cores, against 12 us for a [4, 192] x [192, 576] matmul on one thread. Measured with
    ``SpecModel.generate`` on 2 cores, plain decoding of random Llama targets, 2 threads against 1: hidden 192
    x 16 layers (the demo's shape) 46 against 109 tok/s, 512 x 8 58 against 72, 1024 x 8 35 against 28, 2048 x 4
    27 against 17."""
    if device.type == "cpu" and hidden_size <= ONE_THREAD_MAX_HIDDEN:
        return 1
    return requested


Deliver = Callable[[StreamOutput], None]


class EngineLoop:
    """Messages in (add, abort, call), stream outputs out, one callback per request. The thread starts on the
    first message and runs until :meth:`close` (a daemon)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._deliver: dict[str, Deliver] = {}  # the engine thread's own: request id -> its callback
        self._live: set[str] = set()  # ids submitted and not finished; guarded by _lock
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._num_threads = torch.get_num_threads()  # intra-op threads of the thread that made the model
        self._incoming = 0  # requests announced (on their way: being read, checked) and not yet submitted
        self._held: tuple | None = None  # a message taken between steps run ahead, handled at the step boundary
        self._closed = False
        engine.on_output = self._on_output
        engine.should_yield = self._take_news
        engine.admission.num_incoming = lambda: self._incoming

    def submit(self, prompt: Sequence[int], params: SamplingParams, deliver: Deliver, request_id: str | None = None,
               index: int = 0) -> str:
        """Queue a request (already checked with ``engine.check``); ``deliver`` is called on the engine thread
        with each of its StreamOutputs. Returns its id; a duplicate live id raises ValueError."""
        return self.submit_batch([(prompt, params, request_id, index)], deliver)[0]

    def submit_batch(self, requests: Sequence[tuple[Sequence[int], SamplingParams, str | None, int]], deliver: Deliver,
                     seed: int | None = None) -> list[str]:
        """Queue (prompt, params, request id or None, index) requests in one message, so the engine takes them
        all before its next step (and restarts the batch random stream at ``seed`` first, if given)."""
        ids = [request_id or uuid.uuid4().hex for _, _, request_id, _ in requests]
        with self._lock:
            taken = [i for i in ids if i in self._live] + [i for n, i in enumerate(ids) if i in ids[:n]]
            if taken:
                raise ValueError(f"request id {taken[0]!r} is already running")
            self._live.update(ids)
        items = [(request_id, index, list(prompt), params) for request_id, (prompt, params, _, index)
                 in zip(ids, requests)]
        self._post(("add", items, deliver, seed))
        return ids

    def announce(self) -> Announcement:
        """A request is on its way (a server has begun reading it): an idle engine waits for it (within its
        admission window's cap) so that a burst of arrivals starts together. Settle the announcement once the
        request is submitted or refused."""
        with self._lock:
            self._incoming += 1
        return Announcement(self)

    def _settle(self) -> None:
        with self._lock:
            self._incoming -= 1

    def abort(self, request_id: str) -> None:
        """End a request at the next step boundary ("abort"); its pages are freed there. Unknown ids are
        ignored (the request may have just finished)."""
        self._post(("abort", request_id))

    def call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the engine thread between steps and return its result (or raise its exception)."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._post(("call", fn, done))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def timer(self) -> DecodeTimer:
        """A copy of the engine's decode-step timer, taken between steps."""
        return self.call(lambda: DecodeTimer(**vars(self.engine.timer)))

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the engine's thread at the next step boundary: requests still queued or running end with "abort"
        (pages freed, last outputs delivered) and the thread exits. Later messages raise RuntimeError. Whether the
        thread has ended (False: still inside a step after ``timeout`` seconds)."""
        with self._lock:
            self._closed, thread = True, self._thread
        if thread is None:
            return True
        self._inbox.put(("stop",))
        thread.join(timeout)
        return not thread.is_alive()

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._live)

    def _post(self, message: tuple) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("this model is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="tllm_spec-engine", daemon=True)
                self._thread.start()
        self._inbox.put(message)

    def _on_output(self, out: StreamOutput) -> None:
        deliver = self._deliver.pop(out.request_id) if out.finished else self._deliver.get(out.request_id)
        if out.finished:
            with self._lock:
                self._live.discard(out.request_id)
        if deliver is not None:
            try:
                deliver(out)
            except Exception:  # a consumer that is gone (a closed event loop) must not fail the step
                log.exception("could not deliver an output of request %s", out.request_id)

    def _serve(self) -> None:
        runner = self.engine.runner
        torch.set_num_threads(engine_threads(runner.device, runner.target.hidden_size, self._num_threads))
        if runner.device.type == "cuda":
            torch.cuda.set_device(runner.device)
        with torch.inference_mode(), contextlib.suppress(_Stop):
            while True:
                if self._held is not None:
                    message, self._held = self._held, None
                    self._handle(message)
                if self.engine.num_requests == 0:  # idle: sleep until a message comes
                    self._handle(self._inbox.get())
                while not self._inbox.empty():
                    self._handle(self._inbox.get())
                wait = self.engine.idle_wait()
                if wait > 0.0:  # a burst of arrivals may not be over: sleep until it is or a message comes
                    with contextlib.suppress(queue.Empty):
                        self._handle(self._inbox.get(timeout=wait))
                elif self.engine.num_requests:
                    self._step()

    def _take_news(self) -> bool:
        """Between steps run ahead (``Engine.should_yield``): new requests join the waiting queue at once, so that
        the steps ahead go on while they wait to be admitted; any other message (an abort, a call, requests that
        restart the random stream, set up a grammar or capture a graph) stops the steps ahead and is handled at
        the step boundary. True: stop."""
        while self._held is None:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return False
            if message[0] == "add" and message[3] is None and all(
                    self.engine.joins_quietly(params) for *_, params in message[1]):
                self._handle(message)
            else:
                self._held = message
        return True

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as err:  # the failed step's requests have ended with "error"; keep serving the others
            log.exception("a decoding step failed; its requests ended with finish_reason 'error'")
            self._orphans_fail(err)

    def _orphans_fail(self, err: Exception) -> None:
        """Requests the engine no longer holds but whose last output never went out end with ``err``."""
        held = {r.request_id for r in (*self.engine.waiting, *self.engine.running)}
        for request_id in [i for i in self._deliver if i not in held]:
            self._on_output(StreamOutput(request_id, [], None, True, None, err))

    def _add(self, request_id: str, index: int, prompt: list[int], params: SamplingParams, deliver: Deliver) -> None:
        self._deliver[request_id] = deliver
        try:
            self.engine.add(index, prompt, params, request_id)
        except Exception as err:  # e.g. a capture that failed: this request alone ends
            log.exception("request %s could not be queued", request_id)
            self._on_output(StreamOutput(request_id, [], None, True, None, err))

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, items, deliver, seed = message
            if seed is not None:
                self.engine.runner.reseed(seed)
            for request_id, index, prompt, params in items:
                self._add(request_id, index, prompt, params, deliver)
        elif kind == "abort":
            self.engine.abort(message[1])
        elif kind == "call":
            _, fn, done = message
            try:
                done.put((True, fn()))
            except Exception as err:
                done.put((False, err))
        elif kind == "stop":
            self.engine.abort_all()
            self._orphans_fail(RuntimeError("this model was closed"))
            raise _Stop


class _Stop(Exception):
    """Leaves the engine thread's loop (a "stop" message: :meth:`EngineLoop.close`)."""


class Announcement:
    """One announced request (:meth:`EngineLoop.announce`); :meth:`settle` once, when it is submitted or refused
    (again: no-op)."""

    def __init__(self, loop: EngineLoop):
        self._loop: EngineLoop | None = loop

    def settle(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            loop._settle()
