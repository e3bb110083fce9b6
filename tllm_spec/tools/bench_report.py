"""The serving benchmark's reports: its JSON and CDF plots (matplotlib, when installed) and a table comparing
labelled runs (throughput, prefix-cache hit rate, p50 / p99 latencies)."""
from __future__ import annotations

import json
from pathlib import Path

from .bench_stats import METRICS, series_ms


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
    """One row per run: completions, throughput (and vs the first run), tokens per chunk, the prefix cache's hit
    rate ("-": not reported), p50 / p99 of each latency in ms."""
    head = (f"{'label':<16} {'ok/fail':>8} {'req/s':>7} {'tok/s':>8} {'vs 1st':>6} {'tok/chunk':>9} {'hit':>6} "
            + " ".join(f"{m.upper() + ' p50/p99':>17}" for m in METRICS))
    base = results[0]["summary"]["output_throughput"] if results else 0.0
    return "\n".join([head, *(_row(res["label"], res["summary"], base) for res in results)])


def _row(label: str, s: dict[str, object], base: float) -> str:
    ratio = f"{s['output_throughput'] / base:.2f}x" if base else "-"
    cells = " ".join(f"{_ms(s[f'{m}_ms']['p50']) + ' / ' + _ms(s[f'{m}_ms']['p99']):>17}" for m in METRICS)
    per_chunk = f"{s['mean_tokens_per_chunk']:.2f}" if s["mean_tokens_per_chunk"] else "-"
    hit = s.get("prefix_cache_hit_rate")  # absent from reports written before it was measured
    return (f"{label[:16]:<16} {s['num_completed']:>4}/{s['num_failed']:<3} {s['request_throughput']:7.2f} "
            f"{s['output_throughput']:8.1f} {ratio:>6} {per_chunk:>9} {'-' if hit is None else f'{hit:.1%}':>6} "
            f"{cells}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
