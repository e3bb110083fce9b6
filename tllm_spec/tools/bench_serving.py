"""Serving benchmark over the OpenAI completions API (``tllm-spec serve``, vLLM, any compatible server):
streamed ``POST {base_url}/v1/completions`` at a fixed concurrency or with Poisson arrivals; TTFT, TPOT, ITL and
end-to-end latency percentiles, throughput; a JSON report, CDF plots and a table comparing labelled runs.

Token counting: a speculative server sends 1..K+1 tokens per chunk, so chunks are not tokens. Requests ask for
``stream_options: {"include_usage": true, "continuous_usage_stats": true}``; each record's ``token_count`` says
what came back. ``usage_per_chunk``: every chunk carried the cumulative ``usage.completion_tokens`` (vLLM's
continuous usage), a chunk's tokens are the difference; ITL and TPOT exact. ``usage_total``: only the final usage
chunk; output tokens and TPOT exact, ITL counts a chunk as one token (the chunk gap, as vLLM's benchmark has it).
``chunks``: no usage; output tokens = non-empty chunks, an undercount for a speculative server.

Client-side definitions: TTFT = sent -> first chunk with non-empty text; ITL = the gap between consecutive such
chunks over the later chunk's tokens, one entry per token; TPOT = (E2E - TTFT) / (output tokens - 1); E2E = sent ->
end of stream."""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from itertools import accumulate, pairwise
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, Field

Send = Callable[[int], Awaitable[None]]
QUANTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2e")


class BenchConfig(BaseModel):
    """One benchmark run: the server, the load and the prompts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str = Field("http://127.0.0.1:8000", description="server root; requests go to {base_url}/v1/...")
    model: str | None = Field(None, description="model id; None: the first id of GET /v1/models")
    api_key: str | None = Field(None, description="sent as 'Authorization: Bearer <key>'")
    num_prompts: int = Field(100, ge=1, description="requests in the run")
    concurrency: int | None = Field(None, ge=1, description="workers back to back (None: 1); or a cap on Poisson")
    request_rate: float | None = Field(None, gt=0, description="Poisson arrivals at this many requests/s")
    seed: int = Field(0, description="seeds the random prompts and the arrival times")
    random_input_len: int = Field(128, ge=1, description="tokens per random prompt")
    vocab_size: int | None = Field(None, ge=1, description="random prompt ids lie in [0, vocab_size); None: the "
                                   "served model's, from its GET /v1/models card (tllm-spec serve's say vocab_size)")
    prompt_file: str | None = Field(None, description="UTF-8, a prompt a line, cycled; not random prompts")
    output_len: int = Field(128, ge=1, description="max_tokens of every request (sent with ignore_eos)")
    temperature: float = Field(0.0, ge=0)
    continuous_usage: bool = Field(True, description="ask for usage in every chunk (continuous_usage_stats)")
    timeout_s: float = Field(600.0, gt=0, description="httpx timeout of each request")
    label: str | None = Field(None, description="the run's name in reports (None: the model id)")


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

    def add_event(self, data: str, t: float) -> None:
        """Take one SSE ``data:`` payload that arrived ``t`` s after the request was sent."""
        if data == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise ValueError(f"server error {chunk['error']}")
        usage = (chunk.get("usage") or {}).get("completion_tokens")
        if "".join(c.get("text") or "" for c in chunk.get("choices") or []):
            self.usage_per_chunk &= usage is not None
            self.chunk_times.append(t)
            self.chunk_tokens.append(max(1, usage - sum(self.chunk_tokens)) if usage is not None else 1)
        if usage is not None:
            self.usage_tokens = usage

    def to_json(self) -> dict[str, object]:
        """The record with its output tokens, how they were counted and its TPOT (s)."""
        num_tokens = self.usage_tokens if self.usage_tokens is not None else len(self.chunk_tokens)
        count = "chunks" if self.usage_tokens is None else "usage_per_chunk" if self.usage_per_chunk else "usage_total"
        tpot = (self.e2e - self.ttft) / (num_tokens - 1) if self.ok and num_tokens > 1 else None
        return {**asdict(self), "output_tokens": num_tokens, "token_count": count, "tpot": tpot}


def itl(chunk_times: list[float], chunk_tokens: list[int]) -> list[float]:
    """Per-token inter-token latencies: each gap between chunks split over the later chunk's tokens."""
    return [(t1 - t0) / n for (t0, t1), n in zip(pairwise(chunk_times), chunk_tokens[1:]) for _ in range(n)]


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs, pos = sorted(values), (len(values) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(values) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats_ms(ms: list[float]) -> dict[str, float | None]:
    """Mean, p50, p90 and p99."""
    return {"mean": sum(ms) / len(ms) if ms else None, **{f"p{q}": percentile(ms, q) for q in QUANTILES}}


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num)]


def file_prompts(path: str, num: int) -> list[str]:
    """``num`` prompts from the non-blank lines of a UTF-8 file, cycled; ``\\n`` in a line stands for a newline."""
    lines = [ln.replace("\\n", "\n") for ln in Path(path).read_text(encoding="utf-8-sig").split("\n") if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts")
    return [lines[i % len(lines)] for i in range(num)]


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
                 prompts: list[str] | list[list[int]]) -> tuple[list[RequestRecord], float]:
    records = [RequestRecord() for _ in prompts]
    t0 = time.perf_counter()

    async def send(i: int) -> None:
        records[i].start = time.perf_counter() - t0
        await send_request(client, payload(cfg, model, prompts[i]), records[i])

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
    """Random prompts and max_tokens must fit the served model's ``max_model_len`` (when its card states one)."""
    max_len = card.get("max_model_len")
    if cfg.prompt_file is None and max_len is not None and cfg.random_input_len + cfg.output_len > max_len:
        raise ValueError(f"random_input_len + output_len (--random-input-len, --output-len) = {cfg.random_input_len} "
                         f"+ {cfg.output_len} is more than the served model's max_model_len {max_len}")


async def served_card(client: httpx.AsyncClient, model: str | None) -> dict[str, object]:
    """The GET /v1/models card of ``model`` (None: the first one listed); ``{"id": model}`` when it is not listed."""
    cards = (await client.get("/v1/models")).raise_for_status().json()["data"]
    return cards[0] if model is None else next((c for c in cards if c.get("id") == model), {"id": model})


async def _prompts(cfg: BenchConfig, client: httpx.AsyncClient) -> tuple[str, list[str] | list[list[int]]]:
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


def summarize(requests: list[dict[str, object]], duration: float) -> dict[str, object]:
    """Latency statistics (ms) of the successful requests (``to_json`` dicts), throughput over the run, failures."""
    done = [r for r in requests if r["ok"]]
    num_tokens = sum(r["output_tokens"] for r in done)
    num_chunks = sum(len(r["chunk_times"]) for r in done)
    return {"num_requests": len(requests), "num_completed": len(done), "num_failed": len(requests) - len(done),
            "errors": sorted({r["error"] for r in requests if r["error"]})[:10], "duration_s": duration,
            "request_throughput": len(done) / duration, "output_throughput": num_tokens / duration,
            "num_output_tokens": num_tokens, "mean_tokens_per_chunk": num_tokens / num_chunks if num_chunks else None,
            "token_count": sorted({r["token_count"] for r in done}),
            **{f"{name}_ms": stats_ms(series_ms(done, name)) for name in METRICS}}


def write_report(result: dict[str, object], out_dir: str | Path) -> Path:
    """``bench_serving.json`` and, with matplotlib, ``bench_serving.png`` in ``out_dir``; the JSON's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_serving.json"
    path.write_text(json.dumps(result, indent=1))
    plot_cdfs([result], out / "bench_serving.png")
    return path


def compare(paths: list[str | Path], out_dir: str | Path | None = None) -> str:
    """The table of several result JSONs; with ``out_dir``, also their CDFs in ``bench_serving_compare.png``."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        plot_cdfs(results, Path(out_dir) / "bench_serving_compare.png")
    return format_table(results)


def series_ms(requests: list[dict[str, object]], name: str) -> list[float]:
    """One metric of METRICS in ms over the successful requests (``to_json`` dicts)."""
    ok = [r for r in requests if r["ok"]]
    if name == "itl":
        return [1000 * x for r in ok for x in itl(r["chunk_times"], r["chunk_tokens"])]
    return [1000 * r[name] for r in ok if r[name] is not None]


def plot_cdfs(results: list[dict[str, object]], path: str | Path) -> Path | None:
    """CDFs of TTFT, TPOT and ITL, one line per run; None (and no file) without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(13, 3.8))
    axes = fig.subplots(1, 3)
    for ax, name in zip(axes, ("ttft", "tpot", "itl")):
        for res in results:
            xs = sorted(series_ms(res["requests"], name))
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=str(res["label"]))
        ax.set(xlabel=f"{name.upper()} (ms)", ylabel="fraction", title=f"{name.upper()} CDF")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)


def format_table(results: list[dict[str, object]]) -> str:
    """One row per run: completions, throughput (and vs the first run), p50 / p99 of each latency in ms."""
    head = (f"{'label':<16} {'ok/fail':>8} {'req/s':>7} {'tok/s':>8} {'vs 1st':>6} {'tok/chunk':>9} "
            + " ".join(f"{m.upper() + ' p50/p99':>17}" for m in METRICS))
    base = results[0]["summary"]["output_throughput"] if results else 0.0
    return "\n".join([head, *(_row(res["label"], res["summary"], base) for res in results)])


def _row(label: str, s: dict[str, object], base: float) -> str:
    ratio = f"{s['output_throughput'] / base:.2f}x" if base else "-"
    cells = " ".join(f"{_ms(s[f'{m}_ms']['p50']) + ' / ' + _ms(s[f'{m}_ms']['p99']):>17}" for m in METRICS)
    per_chunk = f"{s['mean_tokens_per_chunk']:.2f}" if s["mean_tokens_per_chunk"] else "-"
    return (f"{label[:16]:<16} {s['num_completed']:>4}/{s['num_failed']:<3} {s['request_throughput']:7.2f} "
            f"{s['output_throughput']:8.1f} {ratio:>6} {per_chunk:>9} {cells}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
