"""Serving benchmark over the OpenAI completions API (``tllm-spec serve``, vLLM, any compatible server):
streamed ``POST {base_url}/v1/completions`` at a fixed concurrency or with Poisson arrivals; TTFT, TPOT, ITL and
end-to-end latency percentiles, throughput, the prefix cache's hit rate. The datasets' prompts are in
bench_datasets.py (random, shared-prefix, multi-turn), the statistics in bench_stats.py, the JSON report, CDF plots
and the table comparing labelled runs in bench_report.py. A multi-turn conversation's turns go one after another:
the concurrency (or the Poisson arrivals) counts conversations.

Token counting: a speculative server sends 1..K+1 tokens per chunk, so chunks are not tokens. Requests ask for
``stream_options: {"include_usage": true, "continuous_usage_stats": true}``; each record's ``token_count`` says
what came back. ``usage_per_chunk``: every chunk carried the cumulative ``usage.completion_tokens`` (vLLM's
continuous usage), a chunk's tokens are the difference; ITL and TPOT exact. ``usage_total``: only the final usage
chunk; output tokens and TPOT exact, ITL counts a chunk as one token (the chunk gap, as vLLM's benchmark has it).
``chunks``: no usage; output tokens = non-empty chunks, an undercount for a speculative server.

Client-side definitions: TTFT = sent -> first chunk with non-empty text; ITL = the gap between consecutive such
chunks over the later chunk's tokens, one entry per token; TPOT = (E2E - TTFT) / (output tokens - 1); E2E = sent ->
end of stream.

Prefix-cache hit rate: the sum of the requests' ``usage.prompt_tokens_details.cached_tokens`` over the sum of their
``usage.prompt_tokens`` (OpenAI's fields; None when the server reports no cached tokens)."""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from itertools import accumulate

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .bench_datasets import (
    Dataset,
    conversation_questions,
    file_prompts,
    longest_prompt,
    next_turn,
    random_prompts,
    shared_prefix_prompts,
)
from .bench_stats import summarize

Send = Callable[[int], Awaitable[None]]
Prompts = list[str] | list[list[int]] | list[list[str]]  # a prompt a request; multi-turn: questions a conversation


class BenchConfig(BaseModel):
    """One benchmark run: the server, the load and the prompts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str = Field("http://127.0.0.1:8000", description="server root; requests go to {base_url}/v1/...")
    model: str | None = Field(None, description="model id; None: the first id of GET /v1/models")
    api_key: str | None = Field(None, description="sent as 'Authorization: Bearer <key>'")
    num_prompts: int = Field(100, ge=1, description="requests in the run (multi-turn: conversations)")
    concurrency: int | None = Field(None, ge=1, description="workers back to back (None: 1); or a cap on Poisson")
    request_rate: float | None = Field(None, gt=0, description="Poisson arrivals at this many requests/s "
                                       "(multi-turn: conversations/s)")
    seed: int = Field(0, description="seeds the random prompts and the arrival times")
    dataset: Dataset = Field("random", description="the prompts (bench_datasets.py)")
    random_input_len: int = Field(128, ge=1, description="tokens per random prompt")
    shared_prefix_len: int = Field(1024, ge=1, description="shared-prefix: tokens of the prefix every prompt shares")
    question_len: int = Field(128, ge=1, description="shared-prefix: tokens of each prompt's own question after "
                              "the prefix; multi-turn: words of each turn's new question")
    turns: int = Field(4, ge=1, description="multi-turn: requests per conversation")
    vocab_size: int | None = Field(None, ge=1, description="prompt ids lie in [0, vocab_size); None: the "
                                   "served model's, from its GET /v1/models card (tllm-spec serve's say vocab_size)")
    prompt_file: str | None = Field(None, description="UTF-8, a prompt a line, cycled; not random prompts")
    output_len: int = Field(128, ge=1, description="max_tokens of every request (sent with ignore_eos)")
    temperature: float = Field(0.0, ge=0)
    continuous_usage: bool = Field(True, description="ask for usage in every chunk (continuous_usage_stats)")
    timeout_s: float = Field(600.0, gt=0, description="httpx timeout of each request")
    label: str | None = Field(None, description="the run's name in reports (None: the model id)")

    @model_validator(mode="after")
    def _prompt_file_is_random(self) -> BenchConfig:
        if self.prompt_file is not None and self.dataset != "random":
            raise ValueError(f"a prompt file (--prompt-file) is its own prompts: not with --dataset {self.dataset}")
        return self

    @property
    def num_requests(self) -> int:
        return self.num_prompts * (self.turns if self.dataset == "multi-turn" else 1)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times in s: ``start`` since the run began, the rest since ``start``."""

    start: float = 0.0
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # one per chunk with non-empty text
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each of those chunks carried
    usage_tokens: int | None = None  # the last usage.completion_tokens seen
    usage_per_chunk: bool = True  # every non-empty chunk carried usage
    done: bool = False  # [DONE] arrived
    prompt_tokens: int | None = None  # the last usage.prompt_tokens seen
    cached_tokens: int | None = None  # the last usage.prompt_tokens_details.cached_tokens seen
    conversation: int | None = None  # multi-turn: which conversation, which turn (from 0)
    turn: int | None = None
    text: str = ""  # the completion's text (not in the JSON)

    def add_event(self, data: str, t: float) -> None:
        """Take one SSE ``data:`` payload that arrived ``t`` s after the request was sent."""
        if data == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise ValueError(f"server error {chunk['error']}")
        usage = chunk.get("usage") or {}
        completion = usage.get("completion_tokens")
        text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
        if text:
            self.text += text
            self.usage_per_chunk &= completion is not None
            self.chunk_times.append(t)
            self.chunk_tokens.append(max(1, completion - sum(self.chunk_tokens)) if completion is not None else 1)
        if completion is not None:
            self.usage_tokens = completion
        self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        self.cached_tokens = self.cached_tokens if cached is None else cached

    def to_json(self) -> dict[str, object]:
        """The record with its output tokens, how they were counted and its TPOT (s)."""
        num_tokens = self.usage_tokens if self.usage_tokens is not None else len(self.chunk_tokens)
        count = "chunks" if self.usage_tokens is None else "usage_per_chunk" if self.usage_per_chunk else "usage_total"
        tpot = (self.e2e - self.ttft) / (num_tokens - 1) if self.ok and num_tokens > 1 else None
        fields = {k: v for k, v in asdict(self).items() if k != "text"}
        return {**fields, "output_tokens": num_tokens, "token_count": count, "tpot": tpot}


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Send times (s since the start) of ``num`` requests at ``rate`` req/s: 0, then exponential gaps."""
    rng = random.Random(seed)
    return list(accumulate((rng.expovariate(rate) for _ in range(num - 1)), initial=0.0))


def payload(cfg: BenchConfig, model: str, prompt: str | list[int]) -> dict[str, object]:
    options = {"include_usage": True, **({"continuous_usage_stats": True} if cfg.continuous_usage else {})}
    return {"model": model, "prompt": prompt, "max_tokens": cfg.output_len, "temperature": cfg.temperature,
            "ignore_eos": True, "stream": True, "stream_options": options}


async def send_request(client: httpx.AsyncClient, body: dict[str, object], record: RequestRecord) -> None:
    """Stream one completion into ``record``; HTTP and stream errors are recorded, never raised."""
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    record.add_event(line[5:].strip(), time.perf_counter() - sent)
                    if record.done:
                        break
    except (httpx.HTTPError, ValueError, TypeError, AttributeError) as err:  # malformed JSON or chunks too
        record.error = f"{type(err).__name__}: {err}"
        return
    _finish(record, time.perf_counter() - sent)


def _finish(record: RequestRecord, e2e: float) -> None:
    record.e2e, record.ttft = e2e, (record.chunk_times[0] if record.chunk_times else None)
    if not record.done:
        record.error = "stream ended before [DONE]"
    elif not record.chunk_times:
        record.error = "no tokens"
    record.ok = record.error is None


async def _closed_loop(send: Send, num: int, workers: int) -> None:
    todo = iter(range(num))  # shared by the workers: each takes the next request when its last one ends

    async def worker() -> None:
        for i in todo:
            await send(i)

    await asyncio.gather(*(worker() for _ in range(min(workers, num))))


async def _open_loop(send: Send, arrivals: list[float], t0: float, cap: int | None) -> None:
    gate = asyncio.Semaphore(cap if cap else len(arrivals))

    async def one(i: int, at: float) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        async with gate:
            await send(i)

    await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))


async def _drive(cfg: BenchConfig, client: httpx.AsyncClient, model: str,
                 prompts: Prompts) -> tuple[list[RequestRecord], float]:
    """Send the requests (multi-turn: conversation i's turns one after another, records i * turns + turn)."""
    records = [RequestRecord() for _ in range(cfg.num_requests)]
    t0 = time.perf_counter()

    async def request(record: RequestRecord, prompt: str | list[int]) -> None:
        record.start = time.perf_counter() - t0
        await send_request(client, payload(cfg, model, prompt), record)

    async def send(i: int) -> None:
        if cfg.dataset != "multi-turn":
            await request(records[i], prompts[i])
            return
        prompt, completion = "", ""
        for turn, question in enumerate(prompts[i]):
            record = records[i * cfg.turns + turn]
            record.conversation, record.turn = i, turn
            prompt = next_turn(prompt, completion, question)
            await request(record, prompt)
            completion = record.text

    if cfg.request_rate is None:
        await _closed_loop(send, len(prompts), cfg.concurrency or 1)
    else:
        await _open_loop(send, poisson_arrivals(len(prompts), cfg.request_rate, cfg.seed), t0, cfg.concurrency)
    return records, time.perf_counter() - t0


def prompt_vocab_size(cfg: BenchConfig, card: dict[str, object]) -> int:
    """The vocabulary random prompts draw from: ``cfg.vocab_size`` (not above the served model's), else the one the
    served model's card of GET /v1/models states. ValueError when neither is known or they disagree."""
    served = card.get("vocab_size")
    if cfg.vocab_size is None and served is None:
        raise ValueError(f"the server's GET /v1/models card of {card.get('id')!r} has no vocab_size: give "
                         "vocab_size (--vocab-size, random prompt ids lie in [0, V)) or a prompt file")
    if cfg.vocab_size is not None and served is not None and cfg.vocab_size > served:
        raise ValueError(f"vocab_size (--vocab-size) {cfg.vocab_size} is more than the served model's {served} "
                         f"token ids: prompts would hold ids it refuses")
    return cfg.vocab_size or served


def check_lengths(cfg: BenchConfig, card: dict[str, object]) -> None:
    """The longest prompt and max_tokens must fit the served model's ``max_model_len`` (when its card states
    one); a prompt file's lines are not measured."""
    max_len = card.get("max_model_len")
    num_tokens, flags = longest_prompt(cfg.dataset, cfg.random_input_len, cfg.shared_prefix_len, cfg.question_len,
                                       cfg.turns, cfg.output_len)
    if cfg.prompt_file is None and max_len is not None and num_tokens + cfg.output_len > max_len:
        raise ValueError(f"the longest prompt ({flags}) + output_len (--output-len) = {num_tokens} + "
                         f"{cfg.output_len} is more than the served model's max_model_len {max_len}")


async def served_card(client: httpx.AsyncClient, model: str | None) -> dict[str, object]:
    """The GET /v1/models card of ``model`` (None: the first one listed); ``{"id": model}`` when it is not listed."""
    cards = (await client.get("/v1/models")).raise_for_status().json()["data"]
    return cards[0] if model is None else next((c for c in cards if c.get("id") == model), {"id": model})


async def _prompts(cfg: BenchConfig, client: httpx.AsyncClient) -> tuple[str, Prompts]:
    """The model id and the prompts; the served model's card is read when the model or the vocabulary is not
    given, and checked against the load when it is read."""
    if cfg.model is not None and (cfg.prompt_file or cfg.vocab_size):
        card = {"id": cfg.model}  # nothing to ask the server: the flags say it all
    else:
        card = await served_card(client, cfg.model)
        check_lengths(cfg, card)
    if cfg.prompt_file:
        return card["id"], file_prompts(cfg.prompt_file, cfg.num_prompts)
    vocab_size = prompt_vocab_size(cfg, card)
    if cfg.dataset == "shared-prefix":
        return card["id"], shared_prefix_prompts(cfg.num_prompts, cfg.shared_prefix_len, cfg.question_len,
                                                 vocab_size, cfg.seed)
    if cfg.dataset == "multi-turn":
        return card["id"], conversation_questions(cfg.num_prompts, cfg.turns, cfg.question_len, vocab_size, cfg.seed)
    return card["id"], random_prompts(cfg.num_prompts, cfg.random_input_len, vocab_size, cfg.seed)


async def arun_benchmark(cfg: BenchConfig) -> dict[str, object]:
    """:func:`run_benchmark` inside a running event loop."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s)) as client:
        model, prompts = await _prompts(cfg, client)
        records, duration = await _drive(cfg, client, model, prompts)
    requests = [r.to_json() for r in records]
    return {"label": cfg.label or model, "model": model, "config": cfg.model_dump(),
            "summary": summarize(requests, duration), "requests": requests}


def run_benchmark(cfg: BenchConfig) -> dict[str, object]:
    """Run the load against the server: ``{"label", "model", "config", "summary", "requests"}``. A failed request
    is recorded, never raised; ValueError for a load the served model cannot take (ids past its vocabulary,
    lengths past its max_model_len), httpx.HTTPError when GET /v1/models fails."""
    return asyncio.run(arun_benchmark(cfg))
