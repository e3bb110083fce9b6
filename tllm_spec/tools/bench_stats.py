"""The serving benchmark's statistics over its request records (``RequestRecord.to_json`` dicts): per-token
inter-token latencies, percentiles, a run's summary (latencies in ms, throughput, failures, the prefix cache's hit
rate)."""
from __future__ import annotations

from itertools import pairwise

QUANTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2e")


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


def summarize(requests: list[dict[str, object]], duration: float) -> dict[str, object]:
    """Latency statistics (ms) of the successful requests (``to_json`` dicts), throughput over the run, failures,
    prompt tokens and the prefix cache's hit rate (None where the server reports no cached tokens)."""
    done = [r for r in requests if r["ok"]]
    num_tokens = sum(r["output_tokens"] for r in done)
    num_chunks = sum(len(r["chunk_times"]) for r in done)
    return {"num_requests": len(requests), "num_completed": len(done), "num_failed": len(requests) - len(done),
            "errors": sorted({r["error"] for r in requests if r["error"]})[:10], "duration_s": duration,
            "request_throughput": len(done) / duration, "output_throughput": num_tokens / duration,
            "num_output_tokens": num_tokens, "mean_tokens_per_chunk": num_tokens / num_chunks if num_chunks else None,
            "token_count": sorted({r["token_count"] for r in done}), **prefix_cache_usage(done),
            **{f"{name}_ms": stats_ms(series_ms(done, name)) for name in METRICS}}


def prefix_cache_usage(requests: list[dict[str, object]]) -> dict[str, object]:
    """Prompt tokens, the cached ones and their ratio over the requests that reported both (None: none did)."""
    prompts = [r["prompt_tokens"] for r in requests if r["prompt_tokens"] is not None]
    both = [(r["prompt_tokens"], r["cached_tokens"]) for r in requests
            if r["prompt_tokens"] is not None and r["cached_tokens"] is not None]
    cached, of = sum(c for _, c in both), sum(n for n, _ in both)
    return {"num_prompt_tokens": sum(prompts) if prompts else None, "num_cached_tokens": cached if both else None,
            "prefix_cache_hit_rate": cached / of if of else None}


def series_ms(requests: list[dict[str, object]], name: str) -> list[float]:
    """One metric of METRICS in ms over the successful requests (``to_json`` dicts)."""
    ok = [r for r in requests if r["ok"]]
    if name == "itl":
        return [1000 * x for r in ok for x in itl(r["chunk_times"], r["chunk_tokens"])]
    return [1000 * r[name] for r in ok if r[name] is not None]
