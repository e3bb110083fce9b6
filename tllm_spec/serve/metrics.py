"""Prometheus metrics of one app (its own CollectorRegistry, so several apps can live in one process).

Read from ``AsyncEngine.state()`` at scrape time: gauges ``tllm_spec_requests_running``,
``tllm_spec_requests_waiting``, the KV pool's pages (below), ``tllm_spec_cuda_graphs`` and
``tllm_spec_compiled_graphs`` (captures and torch.compile graphs so far: flat after start-up); counters
``tllm_spec_prefix_cache_queries_total`` (prompt tokens looked up in the prefix cache at admission) and
``tllm_spec_prefix_cache_hits_total`` (of those, tokens found cached: hits / queries is the hit rate; both stay 0
with prefix caching off, and POST /reset_prefix_cache leaves them be).

KV pages: ``tllm_spec_kv_pages`` is the pool, one page of it scratch (never allocated); every other page is
allocatable or used, so ``tllm_spec_kv_free_pages`` + ``tllm_spec_kv_used_pages`` = ``tllm_spec_kv_pages`` - 1.
``tllm_spec_kv_free_pages`` counts what an allocation can take now: pages that hold nothing worth keeping plus
``tllm_spec_kv_evictable_pages`` (cached prefix pages no request holds, evicted least recently used first when
needed); ``tllm_spec_kv_used_pages`` counts pages requests hold (cached or not, each once however many share it).
The gauges are read while the engine steps, without a lock: only between steps do they add up exactly.

Histograms: ``tllm_spec_time_to_first_token_seconds``, ``tllm_spec_time_per_output_token_seconds`` (first to last
token), ``tllm_spec_accepted_tokens_per_step`` (tokens a generation step accepted, bonus included: 1..K+1, a
tree's 1..depth+1). Counters: ``tllm_spec_requests_total{finish_reason}`` (stop, length, abort, error, rejected),
``tllm_spec_prompt_tokens_total``, ``tllm_spec_generation_tokens_total``."""
from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.async_engine import AsyncEngine
from ..engine.request import RequestOutput, StreamOutput

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    """The engine's occupancy, read when scraped."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        state = self.engine.state()
        yield GaugeMetricFamily("tllm_spec_requests_running", "requests in the decoding batch", state.num_running)
        yield GaugeMetricFamily("tllm_spec_requests_waiting", "requests queued for a batch slot", state.num_waiting)
        yield GaugeMetricFamily("tllm_spec_kv_free_pages", "KV-cache pages an allocation can take now: free plus "
                                "evictable cached prefix pages", state.num_free_kv_pages)
        yield GaugeMetricFamily("tllm_spec_kv_evictable_pages", "cached prefix pages no request holds (counted in "
                                "tllm_spec_kv_free_pages)", state.num_evictable_kv_pages)
        yield GaugeMetricFamily("tllm_spec_kv_used_pages", "KV-cache pages requests hold (free + used = the pool "
                                "less its scratch page)", state.num_used_kv_pages)
        yield GaugeMetricFamily("tllm_spec_kv_pages", "KV-cache pages in the pool, one of them scratch",
                                state.num_kv_pages)
        yield CounterMetricFamily("tllm_spec_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                  state.prefix_cache_queries)
        yield CounterMetricFamily("tllm_spec_prefix_cache_hits", "prompt tokens found in the prefix cache (not "
                                  "prefilled)", state.prefix_cache_hits)
        yield GaugeMetricFamily("tllm_spec_cuda_graphs", "captured CUDA graphs", state.num_cuda_graphs)
        yield GaugeMetricFamily("tllm_spec_compiled_graphs", "graphs torch.compile compiled in this process (a rise "
                                "after start-up: a compile on a request's path)", state.num_compiled_graphs)


class ServerMetrics:
    """The app's registry and the instruments that requests report to."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: AsyncEngine, max_draft_len: int):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        reg = self.registry
        self.time_to_first_token = Histogram("tllm_spec_time_to_first_token_seconds", "request arrival to its first "
                                             "generated token", buckets=_TTFT_BUCKETS, registry=reg)
        self.time_per_output_token = Histogram("tllm_spec_time_per_output_token_seconds", "first to last token, "
                                               "per token after the first", buckets=_TPOT_BUCKETS, registry=reg)
        self.accepted_tokens_per_step = Histogram("tllm_spec_accepted_tokens_per_step", "tokens a generation step "
                                                  "accepted, bonus included", registry=reg,
                                                  buckets=tuple(range(1, max_draft_len + 2)))
        self.requests = Counter("tllm_spec_requests", "finished requests by finish reason", ["finish_reason"],
                                registry=reg)
        self.prompt_tokens = Counter("tllm_spec_prompt_tokens", "prompt tokens of admitted requests", registry=reg)
        self.generation_tokens = Counter("tllm_spec_generation_tokens", "generated tokens", registry=reg)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, num_prompt_tokens: int) -> RequestTracker:
        """Start timing an admitted request (now is its arrival)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestTracker(self)

    def reject(self) -> None:
        """A request the engine refused before it started."""
        self.requests.labels(finish_reason="rejected").inc()


class RequestTracker:
    """One request's timings, fed each StreamOutput; ``close`` records an early end: "abort" (the client left) or
    "error" (the engine failed)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first_token_time: float | None = None
        self.num_tokens = 0
        self.done = False

    def observe(self, out: StreamOutput) -> None:
        now = time.perf_counter()
        if out.token_ids and self.first_token_time is None:
            self.first_token_time = now
            self.metrics.time_to_first_token.observe(now - self.start)
        self.num_tokens += len(out.token_ids)
        self.metrics.generation_tokens.inc(len(out.token_ids))
        if out.finished and out.output is not None:
            self._finish(out.output.finish_reason, now, out.output)

    def close(self, finish_reason: str) -> None:
        if not self.done:
            self._finish(finish_reason, time.perf_counter())

    def _finish(self, finish_reason: str, now: float, output: RequestOutput | None = None) -> None:
        self.done = True
        self.metrics.requests.labels(finish_reason=finish_reason).inc()
        if self.first_token_time is not None and self.num_tokens > 1:
            self.metrics.time_per_output_token.observe((now - self.first_token_time) / (self.num_tokens - 1))
        for num_accepted in output.stats.accepted_per_step if output is not None else ():
            self.metrics.accepted_tokens_per_step.observe(num_accepted)
