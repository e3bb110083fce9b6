"""The calling side of the engine loop: a request's stream of outputs (iterated in the caller's thread), and a
batch of prompts decoded to completion (``generate``). Input is checked here, in the caller's thread, so a bad
request is refused alone and a warning points at the caller's line."""
from __future__ import annotations

import queue
import time
import warnings
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from ..config import SamplingParams
from .loop import EngineLoop
from .request import AcceptanceStats, GenerationOutputs, RequestOutput, StreamOutput

_ABORT_WAIT_S = 30.0  # how long an interrupted caller waits for its requests' pages to come back
_INTERRUPT_POLL_S = 0.1  # the caller's longest wait for an output before it checks for a Ctrl-C


class RequestStream:
    """``for out in stream``: the request's StreamOutputs, the last with ``finished``; a step that failed raises
    its exception here. One iterator for the stream's life (``next(iter(s))`` then ``list(s)`` see every
    output once). ``close()`` (or leaving ``with stream:``, or the stream being garbage collected, or an exception
    or Ctrl-C while iterating) aborts a request that has not finished."""

    def __init__(self, loop: EngineLoop, prompt: list[int], params: SamplingParams, request_id: str | None = None):
        self.loop = loop
        self._queue: queue.SimpleQueue[StreamOutput] = queue.SimpleQueue()
        self.request_id = loop.submit(prompt, params, self._queue.put, request_id)
        self.finished = False
        self._outputs = self._generate()

    def __iter__(self) -> Iterator[StreamOutput]:
        return self._outputs

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._outputs.close()
        if not self.finished:
            self.loop.abort(self.request_id)

    def _generate(self) -> Iterator[StreamOutput]:
        try:
            while not self.finished:
                out = self._queue.get()
                self.finished = out.finished
                if out.exception is not None:
                    raise out.exception
                yield out
        finally:
            if not self.finished:
                self.loop.abort(self.request_id)

    def result(self) -> RequestOutput:
        """Wait for the whole output."""
        last = None
        for last in self:
            pass
        return last.output


def check_prompt(loop: EngineLoop, prompt: object, params: object) -> tuple[list[int] | None, str | None]:
    """(token ids, None) or (None, why the request is refused): strings need a tokenizer, ids must be ints in
    the vocabulary, the params a SamplingParams (a dict is validated into one)."""
    if isinstance(params, dict):
        try:
            params = SamplingParams.model_validate(params)
        except ValueError as err:
            return None, f"invalid sampling params: {err}".replace("\n", "; ")
    if isinstance(prompt, str):
        if loop.engine.tokenizer is None:
            return None, "a string prompt needs a tokenizer; this target directory has none (pass token ids)"
        prompt = loop.engine.encode(prompt)
    elif not isinstance(prompt, (list, tuple)):
        return None, f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}"
    prompt = list(prompt)
    return (prompt, None) if (error := loop.engine.check(prompt, params)) is None else (None, error)


def as_params(params: object) -> SamplingParams:
    return SamplingParams.model_validate(params) if isinstance(params, dict) else params


def generate(loop: EngineLoop, prompts: Sequence[str | list[int]], sampling_params: object = None, seed: int = 0,
             progress: bool = False, stacklevel: int = 3) -> GenerationOutputs:
    """Decode ``prompts`` to completion. A refused prompt gets a "rejected" output (and a warning), the others
    run; Ctrl-C or an exception in the caller aborts this call's requests and waits for their pages."""
    if not isinstance(prompts, (list, tuple)) or any(not isinstance(p, (str, list, tuple)) for p in prompts):
        raise TypeError("prompts must be a list of strings or of token-id lists (one per request)")
    params = sampling_params if sampling_params is not None else SamplingParams()
    params = [params] * len(prompts) if isinstance(params, (SamplingParams, dict)) else list(params)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    outputs: list[RequestOutput | None] = [None] * len(prompts)
    accepted = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        ids, error = check_prompt(loop, prompt, p)
        if error:
            warnings.warn(f"request {i} rejected: {error}", stacklevel=stacklevel)
            ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
            outputs[i] = RequestOutput(i, ids, [], "rejected", AcceptanceStats(loop.engine.max_accepted_drafts),
                                         error=error)
        else:
            accepted.append((i, ids, as_params(p)))
    start = time.perf_counter()
    timer_before = loop.timer()
    _run_batch(loop, accepted, seed, progress, outputs)
    for i, _, _ in accepted:  # refused by the engine thread (a grammar the backend cannot compile)
        if outputs[i].finish_reason == "rejected":
            warnings.warn(f"request {i} rejected: {outputs[i].error}", stacklevel=stacklevel)
    return _summarise(outputs, time.perf_counter() - start, loop.timer().minus(timer_before),
                      loop.engine.max_accepted_drafts)


def _run_batch(loop: EngineLoop, accepted: list[tuple[int, list[int], SamplingParams]], seed: int, progress: bool,
               outputs: list[RequestOutput | None]) -> None:
    inbox: queue.SimpleQueue[StreamOutput] = queue.SimpleQueue()
    total = sum(min(len(prompt) + p.max_new_tokens, loop.engine.max_seq_len) - len(prompt) for _, prompt, p in accepted)
    pending, failure = set(), None
    try:  # from the submission on: a Ctrl-C right after it still aborts what was submitted
        ids = loop.submit_batch([(prompt, p, None, i) for i, prompt, p in accepted], inbox.put, seed)
        pending, index = set(ids), dict(zip(ids, (i for i, _, _ in accepted)))
        with tqdm(total=total, unit="tok", disable=not progress, desc="generate") as bar:
            while pending:
                try:  # a bounded wait: a Ctrl-C is taken within it even while no output comes (a long prefill)
                    out = inbox.get(timeout=_INTERRUPT_POLL_S)
                except queue.Empty:
                    continue
                bar.update(len(out.token_ids))
                if out.finished:
                    pending.discard(out.request_id)
                    outputs[index[out.request_id]] = out.output
                    failure = failure or out.exception
    except BaseException:
        for request_id in pending:
            loop.abort(request_id)
        _wait_for(inbox, pending)
        raise
    if failure is not None:
        raise failure


def _wait_for(inbox: queue.SimpleQueue, pending: set[str]) -> None:
    """Wait (bounded) until every pending request has ended, so its pages are free when the caller goes on."""
    deadline = time.monotonic() + _ABORT_WAIT_S
    while pending and (left := deadline - time.monotonic()) > 0:
        try:
            out = inbox.get(timeout=left)
        except queue.Empty:
            return
        if out.finished:
            pending.discard(out.request_id)


def _summarise(outputs: list[RequestOutput | None], seconds: float, timer, k: int) -> GenerationOutputs:
    result = GenerationOutputs(outputs)
    total = AcceptanceStats(k)
    for o in outputs:
        if o is not None and o.finish_reason != "rejected":
            total.merge(o.stats)
    num_tokens = sum(len(o.token_ids) for o in outputs if o is not None)
    result.stats = {"num_requests": len(outputs), "num_tokens": num_tokens, "seconds": round(seconds, 4),
                    "tokens_per_second": round(num_tokens / seconds, 2) if seconds > 0 else 0.0,
                    **total.summary(), **timer.summary()}
    return result
