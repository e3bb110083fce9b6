"""The FastAPI app: ``build_app(model, model_name, api_key, max_queue)``.

Routes: POST /v1/completions and /v1/chat/completions (``stream`` false: one JSON body; true: server-sent events),
GET /v1/models, GET /metrics (Prometheus text), GET /health (no key needed), POST /reset_prefix_cache (vLLM's:
forget every cached prompt page, so the next requests prefill from their first token; pages requests hold stay
theirs). A request is checked by the engine (``AsyncEngine.check``) before it is admitted, so a refused one
answers 400 and never starts a 200 stream. At most ``max_queue`` requests are in flight (admitted and not yet
answered in full); beyond that, 429. With ``api_key`` every route but /health answers 401 without
``Authorization: Bearer KEY``.

The event loop and the engine's thread share one interpreter: with Python's default 5 ms switch interval, the
engine's thread could wait up to 5 ms for the GIL whenever the loop is busy writing a batch's chunks, so the
server sets a GIL_SWITCH_INTERVAL_S interval (a tiny random model on a 2-core CPU, concurrency 32: TPOT 1.45x the
offline step per token at 5 ms, 1.02x at 0.5 ms; `scripts/serving_vs_offline.py --shape tiny --device cpu`). On an
H200 (8B shape, 512 requests at concurrency 64) 0.1 ms gave a median 0.93x offline throughput over 8 runs against
0.88x over 12 runs at 0.5 ms (docs/benchmarks/h200-serving-ab)."""
from __future__ import annotations

import asyncio
import hmac
import sys
import time
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..config import SamplingParams
from ..engine.async_engine import announced
from ..engine.loop import EngineLoop
from ..spec_model import SpecModel
from .errors import APIError, install_error_handlers
from .generation import EventStream, Job, event_stream, run_to_end
from .grammar_check import GrammarCheck
from .logprobs import LogprobsFormat, TokenTexts
from .metrics import ServerMetrics
from .protocol import ModelCard, ModelList
from .requests import ChatCompletionRequest, CompletionRequest, GenerationRequest
from .structured import guided_decoding
from .template import ChatTemplate
from .tool_calls import ToolCallFormat, tool_call_format

DEFAULT_MAX_QUEUE = 256
GIL_SWITCH_INTERVAL_S = 0.0001
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of max_seq_len


class Admission:
    """Counts requests in flight (on the event loop's thread only); ``enter`` past ``max_in_flight`` is a 429,
    and once ``closed`` (the server is shutting down) a 503."""

    def __init__(self, max_in_flight: int):
        self.max_in_flight = max_in_flight
        self.num_in_flight = 0
        self.closed = False

    def enter(self) -> None:
        if self.closed:
            raise APIError(503, "the server is shutting down and admits no new requests", code="shutting_down")
        if self.num_in_flight >= self.max_in_flight:
            raise APIError(429, f"the server is overloaded ({self.num_in_flight} requests in flight, the limit "
                           f"is {self.max_in_flight}); retry later", code="overloaded")
        self.num_in_flight += 1

    def leave(self) -> None:
        self.num_in_flight -= 1


class Server:
    """What the routes share: the engine, the served name, the metrics, admission and the chat template."""

    def __init__(self, model: SpecModel, model_name: str, max_queue: int):
        self.engine = model.async_engine
        self.model_name = model_name
        self.max_seq_len = model.engine.max_seq_len
        self.vocab_size = model.runner.vocab_size
        self.metrics = ServerMetrics(self.engine, model.runner.max_accepted_drafts)
        self.admission = Admission(max_queue)
        self.template = ChatTemplate(model.tokenizer, model.encode)
        self.token_texts = TokenTexts(self.engine.decode_each)  # on the event loop's thread only
        self.grammars = GrammarCheck(model.runner)
        self.running: dict[str, Job] = {}  # admitted and not yet answered in full; on the event loop's thread
        self.prefix_cache = model.engine.prefix_cache  # read only: whether it is on (a benchmark may switch it)
        self.created = int(time.time())

    async def generate(self, body: GenerationRequest, prompt: str | list[int], request: Request,
                       tool_calls: ToolCallFormat | None = None) -> Response:
        """Check, admit and run one request; a stream keeps its admission until its last event is sent."""
        params, guided_field = self._sampling_params(body, tool_calls)
        self.admission.enter()
        try:
            job = await self._job(body, prompt, params, guided_field, tool_calls)
        except BaseException:
            self.admission.leave()
            raise
        self.running[job.request_id] = job
        if body.stream:
            return EventStream(event_stream(self.engine, job), on_close=lambda: self._leave(job))
        try:
            result = await run_to_end(self.engine, job, request.is_disconnected)
        finally:
            self._leave(job)
        return JSONResponse(result.model_dump(mode="json"))

    async def reset_prefix_cache(self) -> None:
        """Forget the cached prompt pages; it waits for the engine's step boundary, so off the event loop. 503 once
        the engine has stopped (shutdown)."""
        try:
            await asyncio.to_thread(self.engine.reset_prefix_cache)
        except RuntimeError as err:  # the engine's thread has stopped
            raise APIError(503, f"the prefix cache cannot be reset: {err}", code="shutting_down") from err

    def abort_all(self) -> int:
        """Abort every request in flight (a shutdown's grace period is over); returns how many."""
        for request_id in self.running:
            self.engine.abort(request_id)
        return len(self.running)

    def _leave(self, job: Job) -> None:
        self.running.pop(job.request_id, None)
        self.admission.leave()

    def _sampling_params(self, body: GenerationRequest, tool_calls: ToolCallFormat | None
                         ) -> tuple[SamplingParams, str | None]:
        """(params, the field that constrains the output); 404 for another model's name; 400 for a field not
        supported, a malformed output constraint or a sampling value the engine refuses. max_new_tokens is the
        request's, or 1 until the prompt is known."""
        if body.model not in (None, self.model_name):
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")
        body.refuse_unsupported()
        guided, field = guided_decoding(body, tool_calls.schema() if tool_calls is not None else None)
        requested = body.requested_max_tokens
        return body.sampling_params(requested if requested is not None else 1, guided_decoding=guided), field

    async def _job(self, body: GenerationRequest, prompt: str | list[int], params: SamplingParams,
                   guided_field: str | None, tool_calls: ToolCallFormat | None) -> Job:
        """The engine's verdict on the request (400 if refused), then the job that runs it."""
        chat = isinstance(body, ChatCompletionRequest)
        ids, error, param = await asyncio.to_thread(self._check, prompt, params)  # tokenizes: off the event loop
        if error:
            self.metrics.reject()
            raise APIError(400, error, guided_field if param == "grammar" else param or ("messages" if chat else
                                                                                          "prompt"))
        params = params.model_copy(update={"max_new_tokens": self._max_new_tokens(body, len(ids))})
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        logprobs_format = LogprobsFormat(chat, self.token_texts) if params.logprobs is not None else None
        return Job(request_id, ids, params, self.model_name, chat, self.metrics.track(len(ids)), body.include_usage,
                   body.continuous_usage, logprobs_format, tool_calls)

    def _check(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int] | None, str | None,
                                                                               str | None]:
        """(token ids, None, None) or (None, why the request is refused, the field at fault); any thread."""
        if params.guided_decoding is not None:
            error = self.grammars.check(params.guided_decoding)
            if error:
                return None, error, "grammar"
        ids, error = self.engine.check(prompt, params)
        return ids, error, "stop_token_ids" if error and error.startswith("stop_token_ids") else None

    def _max_new_tokens(self, body: GenerationRequest, num_prompt_tokens: int) -> int:
        """The request's max_tokens if it fits the context (else a 400 with the arithmetic); without one, the rest
        of the context (chat) or COMPLETION_MAX_TOKENS of it (completions)."""
        room = self.max_seq_len - num_prompt_tokens
        requested, chat = body.requested_max_tokens, isinstance(body, ChatCompletionRequest)
        if requested is None:
            return room if chat else min(COMPLETION_MAX_TOKENS, room)
        if requested > room:
            param = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
            raise APIError(400, f"{param} is {requested}, but the context holds {self.max_seq_len} tokens and the "
                           f"prompt takes {num_prompt_tokens}: at most {room} can be generated", param)
        return requested


def _server(request: Request) -> Server:
    return request.app.state.server


routes = APIRouter()


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


@routes.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await _server(request).generate(body, body.single_prompt(), request)


@routes.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    server = _server(request)
    tool_calls = tool_call_format(body)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    prompt = server.template.render(body.template_messages(), tools)
    return await server.generate(body, prompt, request, tool_calls)


@routes.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    server = _server(request)
    return ModelList(data=[ModelCard(id=server.model_name, created=server.created, max_model_len=server.max_seq_len,
                                     vocab_size=server.vocab_size)])


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    server_metrics = _server(request).metrics
    return Response(server_metrics.render(), media_type=server_metrics.content_type)


@routes.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict[str, object]:
    server = _server(request)
    await server.reset_prefix_cache()
    return {"status": "ok", "prefix_caching": server.prefix_cache.enabled}


@routes.get("/health")
async def health(request: Request) -> Response:
    return Response(status_code=503 if _server(request).admission.closed else 200)


class BearerAuth:
    """ASGI middleware: 401 (OpenAI's error body) for any request but /health without the key, before its body
    is read."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AnnounceRequests:
    """ASGI middleware: a completion request is announced to the engine from the moment the server starts reading
    it until it is submitted (or refused), so that an idle engine starts a burst of requests together instead of
    the first one alone (EngineLoop.announce)."""

    def __init__(self, app: ASGIApp, loop: EngineLoop):
        self.app, self.loop = app, loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        with announced(self.loop):
            await self.app(scope, receive, send)


def build_app(model: SpecModel, model_name: str, api_key: str | None = None,
              max_queue: int = DEFAULT_MAX_QUEUE) -> FastAPI:
    """The OpenAI-compatible app over ``model``'s engine (see the module docstring)."""
    if model.tokenizer is None:
        raise ValueError("serving needs the target's tokenizer (text in and out); this target directory has none")
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
    app = FastAPI(title="tllm_spec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = Server(model, model_name, max_queue)
    install_error_handlers(app)
    app.include_router(routes)
    app.add_middleware(AnnounceRequests, loop=model.loop)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    return app
