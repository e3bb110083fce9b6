"""One admitted request run against the engine: to its end (one JSON body) or as server-sent events.

A stream is ``data: {chunk}\\n\\n`` per step that completed text (with the logprobs of its tokens and of those held
back before it, when asked for), the last content chunk carrying ``finish_reason``, an optional usage chunk
(``stream_options.include_usage``; with vLLM's ``continuous_usage_stats`` every chunk carries the usage so far, its
``prompt_tokens_details`` from the last content chunk on), then ``data: [DONE]\\n\\n``. A request that fails
after its 200 sends ``data: {"error": {...}}`` before ``[DONE]``. Leaving early (a client that disconnects) closes
the engine's generator, which aborts the request and frees its pages at the next step."""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..config import SamplingParams
from ..engine.async_engine import AsyncEngine
from ..engine.request import RequestOutput, StreamOutput
from .errors import APIError
from .logprobs import LogprobsFormat
from .metrics import RequestTracker
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    Usage,
)
from .tool_calls import ToolCallFormat

log = logging.getLogger("tllm_spec.serve")
DONE_EVENT = "data: [DONE]\n\n"


@dataclass
class Job:
    """An admitted request: what the engine runs and what its responses are stamped with."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    model_name: str
    chat: bool
    tracker: RequestTracker
    include_usage: bool = False
    continuous_usage: bool = False  # every chunk carries the usage so far
    logprobs_format: LogprobsFormat | None = None  # the request asked for logprobs
    tool_calls: ToolCallFormat | None = None  # the output is tool calls (chat with tools and a tool_choice)
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, output: RequestOutput, usage: Usage) -> BaseModel:
        head = {"id": self.request_id, "created": self.created, "model": self.model_name, "usage": usage}
        text, finish_reason = output.text or "", finish_reason_of(output)
        logprobs = self.logprobs(output.token_ids, output.logprobs, output.top_logprobs)
        if self.chat:
            content, calls = text, None
            if self.tool_calls is not None:
                content, calls, finish_reason = self.tool_calls.message(text, finish_reason)
            choice = ChatChoice(message=AssistantMessage(content=content, tool_calls=calls), logprobs=logprobs,
                                finish_reason=finish_reason)
            return ChatCompletionResponse(**head, choices=[choice])
        choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason)
        return CompletionResponse(**head, choices=[choice])

    def chunk(self, text: str | None, finish_reason: str | None, first: bool = False,
              usage: Usage | None = None, logprobs: BaseModel | None = None, delta: DeltaMessage | None = None
              ) -> BaseModel:
        """A stream chunk; ``text=None`` is the usage chunk (no choices). ``delta``: a chat chunk's own delta
        (tool calls) instead of ``text``'s."""
        head = {"id": self.request_id, "created": self.created, "model": self.model_name, "usage": usage}
        if self.chat:
            delta = delta or DeltaMessage(role="assistant" if first else None, content=text)
            choices = [] if text is None else [ChatChunkChoice(delta=delta, logprobs=logprobs,
                                                               finish_reason=finish_reason)]
            return ChatCompletionChunk(**head, choices=choices)
        choices = [] if text is None else [CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason)]
        return CompletionResponse(**head, choices=choices)

    def logprobs(self, token_ids: list[int], logprobs: list[float] | None,
                 top_logprobs: list[dict[int, float]] | None) -> BaseModel | None:
        """The tokens' logprobs in the endpoint's shape; None when the request did not ask for them."""
        if self.logprobs_format is None or logprobs is None:
            return None
        return self.logprobs_format(token_ids, logprobs, top_logprobs)

    def usage(self, output: RequestOutput) -> Usage:
        return Usage.of(len(self.prompt_ids), len(output.token_ids), output.stats.cached_prompt_tokens)


async def _outputs(engine: AsyncEngine, job: Job) -> AsyncIterator[StreamOutput]:
    """The engine's outputs, each reported to the job's tracker; closing this aborts the request."""
    try:
        async with aclosing(engine.generate(job.prompt_ids, job.params, job.request_id)) as outputs:
            async for out in outputs:
                job.tracker.observe(out)
                yield out
    except Exception:
        job.tracker.close("error")
        raise
    finally:
        job.tracker.close("abort")  # no-op when the request finished


def finish_reason_of(output: RequestOutput) -> str:
    """The response's finish reason, "stop" or "length"; an abort, an engine error or a late rejection (a grammar
    the engine could not compile) is an APIError instead."""
    if output.finish_reason in ("stop", "length"):
        return output.finish_reason
    if output.finish_reason == "rejected":
        raise APIError(400, output.error or "the engine rejected the request")
    if output.finish_reason == "abort":
        raise APIError(503, "the request was aborted: the server is shutting down", code="aborted")
    raise APIError(500, f"generation failed: {output.error or 'engine error'}")


def _engine_failure(err: Exception) -> APIError:
    log.error("request failed in the engine: %s: %s", type(err).__name__, err)
    return APIError(500, f"generation failed: {type(err).__name__}: {err}")


async def run_to_end(engine: AsyncEngine, job: Job, disconnected: Callable[[], Awaitable[bool]]) -> BaseModel:
    """The whole response. Between steps it asks ``disconnected``: a client gone aborts the request."""
    output = None
    try:
        async with aclosing(_outputs(engine, job)) as outputs:
            async for out in outputs:
                if out.finished:
                    output = out.output
                elif await disconnected():
                    raise APIError(499, "the client disconnected", code="client_disconnected")
    except APIError:
        raise
    except Exception as err:  # a failed step's exception, re-raised by AsyncEngine.generate
        raise _engine_failure(err) from err
    return job.response(output, job.usage(output))


async def event_stream(engine: AsyncEngine, job: Job) -> AsyncIterator[str]:
    """Server-sent events of the request (see the module docstring)."""
    try:
        async with aclosing(_events(engine, job)) as events:
            async for event in events:
                yield event
    except APIError as err:
        yield err.event()
    except Exception as err:  # noqa: BLE001 (a failed step's exception, whatever it is, ends the stream)
        yield _engine_failure(err).event()
    yield DONE_EVENT


async def _events(engine: AsyncEngine, job: Job) -> AsyncIterator[str]:
    first, num_tokens, text = True, 0, ""
    pending = _PendingLogprobs()  # of tokens whose text has not gone out yet (held back at a stop string's start)
    async with aclosing(_outputs(engine, job)) as outputs:
        async for out in outputs:
            num_tokens += len(out.token_ids)
            text += out.text or ""
            pending.add(out)
            finish_reason = finish_reason_of(out.output) if out.finished else None
            delta = None
            if job.tool_calls is not None:
                shaped = job.tool_calls.delta(out.text or "", text, first, finish_reason)
                if shaped is None:
                    continue
                delta, finish_reason = shaped
            if out.text or out.finished or delta is not None:
                usage = _usage_so_far(job, num_tokens, out) if job.continuous_usage else None
                yield _event(job.chunk(out.text or "", finish_reason, first, usage, pending.take(job), delta))
                first = False
            if out.finished and job.include_usage:
                yield _event(job.chunk(None, None, usage=job.usage(out.output)))


def _usage_so_far(job: Job, num_tokens: int, out: StreamOutput) -> Usage:
    """A continuous-usage chunk's usage (the cached prompt tokens are known from the request's admission on)."""
    return Usage.of(len(job.prompt_ids), num_tokens, out.cached_prompt_tokens)


class _PendingLogprobs:
    """A stream's token logprobs, gathered until a chunk carries them."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []

    def add(self, out: StreamOutput) -> None:
        if out.logprobs is not None:
            self.token_ids += out.token_ids
            self.logprobs += out.logprobs
            self.top_logprobs += out.top_logprobs

    def take(self, job: Job) -> BaseModel | None:
        """The gathered logprobs in the job's shape (None if it did not ask for them); then none are pending."""
        shaped = job.logprobs(self.token_ids, self.logprobs, self.top_logprobs)
        self.token_ids, self.logprobs, self.top_logprobs = [], [], []
        return shaped


def _event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response that always closes its generator (a client that disconnects while a chunk is
    being sent would otherwise leave it suspended until garbage collection) and then calls ``on_close``."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.events, self.on_close = events, on_close

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.events.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
