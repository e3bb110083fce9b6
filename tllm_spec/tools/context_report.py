"""The long-context benchmark run (``scripts/benchmark.py --context``): the decode points of each mode, then the
attention microbenchmark (whose FlashInfer kernels may first compile for minutes); the JSON is rewritten after
every entry (a run cut short keeps what it measured), then a table and a plot (roofline fraction against
context)."""
from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .attention_bench import BACKENDS, attention_entries
from .benchmark import measure_bandwidth
from .context_bench import GIB, context_points, plan_for, random_target


@dataclass(frozen=True)
class ContextRun:
    """What ``--context`` measures."""

    shape: str
    batches: list[int]
    contexts: list[int]
    k: int
    new_tokens: int
    kv_cache_fraction: float
    max_prefill_tokens: int
    compile_step: bool
    attention_backends: list[str]
    attention_only: bool
    kv_cache_dtypes: tuple[str, ...] = ("auto",)  # each point per KV pool dtype ("auto" = the target's bf16)
    quantization: str | None = None  # the target quantized online ("fp8"), its weights read as stored


def add_context_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--context`` flags of scripts/benchmark.py (its --shape, --batches, -k and --new-tokens apply)."""
    g = parser.add_argument_group("long context (--context; --shape, --batches, -k and --new-tokens apply)")
    g.add_argument("--context", type=int, nargs="+", metavar="TOKENS", help="prompt lengths: run the long-context "
                   "benchmark instead (no speculation and EAGLE-3 with K of K drafts forced; a point whose KV does "
                   "not fit is skipped with the reason)")
    g.add_argument("--attention-backends", nargs="+", choices=BACKENDS, default=[], help="also time the verify "
                   "step's attention alone (B x 4 queries, 32 / 8 heads, head_dim 128) with these backends")
    g.add_argument("--attention-only", action="store_true", help="only the attention microbenchmark")
    g.add_argument("--context-json", help="also write the JSON and its plot here (the copy to commit, e.g. "
                   "docs/benchmarks/h200-llama-3.1-8b-context.json)")
    g.add_argument("--kv-cache-fraction", type=float, default=0.7, help="share of the GPU memory left after the "
                   "target's weights that the KV pool may take")
    g.add_argument("--max-prefill-tokens", type=int, default=65536, help="prompt tokens added to the engine at "
                   "once (whole prompts, at least one): bounds the memory of a prefill step")
    g.add_argument("--no-compile", action="store_true", help="no torch.compile of the step (CUDA graphs still "
                   "captured): saves minutes of compilation; the steps are slower")


def check_context_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (parser.error) long-context flags without --context and values out of range."""
    given = [f for f in ("attention_backends", "attention_only", "context_json", "no_compile") if getattr(args, f)]
    if given and not args.context:
        parser.error(f"--{given[0].replace('_', '-')} needs --context")
    if args.attention_only and not args.attention_backends:
        parser.error("--attention-only needs --attention-backends")
    if args.context and args.tensor_parallel_size > 1:
        parser.error("--context runs on one GPU")
    if not 0 < args.kv_cache_fraction < 1 or args.max_prefill_tokens < 1 or min(args.context or [1]) < 1:
        parser.error("--kv-cache-fraction lies in (0, 1); --max-prefill-tokens and --context are positive")


def context_run(args: argparse.Namespace) -> ContextRun:
    kv = ("auto", "fp8") if getattr(args, "kv_cache_dtype", "auto") == "fp8" else ("auto",)  # fp8: bf16 beside
    return ContextRun(args.shape, args.batches, args.context, args.max_draft_len, args.new_tokens,
                      args.kv_cache_fraction, args.max_prefill_tokens, not args.no_compile, args.attention_backends,
                      args.attention_only, kv, getattr(args, "quantization", None))


def run_context_benchmark(run: ContextRun, out: Path, json_copy: Path | None = None) -> dict:
    """Measure, writing ``out``/context.json (and ``json_copy``) after every entry and a plot beside each."""
    device, began = torch.device("cuda"), time.perf_counter()

    def log(text: str) -> None:  # elapsed seconds first: what each stage costs, for planning the next run
        tqdm.write(f"[{time.perf_counter() - began:6.1f} s] {text}")

    bandwidth = measure_bandwidth(device)
    log(f"bandwidth: GEMV {bandwidth['gemv'] / 1e12:.2f} TB/s, read {bandwidth['read'] / 1e12:.2f} TB/s")
    results = {"kind": "context", "gpu": torch.cuda.get_device_name(device), "shape": run.shape, "k": run.k,
               "dtype": "bfloat16", "quantization": run.quantization, "date": time.strftime("%Y-%m-%d"),
               "new_tokens": run.new_tokens,
               "bandwidth_bytes_per_s": bandwidth, "kv_cache_fraction": run.kv_cache_fraction,
               "max_prefill_tokens": run.max_prefill_tokens, "compile_step": run.compile_step, "kv_pool": None,
               "points": [], "attention": []}
    paths = [out / "context.json"] + ([json_copy] if json_copy is not None else [])

    def save() -> None:
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(results, indent=2))

    if not run.attention_only:
        _decode_points(run, bandwidth["gemv"], results, save, log)
        gc.collect()  # the target, before the attention's caches
        torch.cuda.empty_cache()
    for entry in attention_entries(run.attention_backends, run.batches, run.contexts, bandwidth["gemv"], device):
        results["attention"].append(entry)
        save()
        log(format_attention(entry))
    save()
    print(table(results))
    for path in paths:
        if plot_context(results, path.with_suffix(".png")) is None:
            print("matplotlib not installed: plot skipped (pip install -e '.[plot]'; then --plot-only)")
    return results


def _decode_points(run: ContextRun, bandwidth: float, results: dict, save: Callable[[], None],
                   log: Callable[[str], None]) -> None:
    """Each mode's points (the first of a mode also pays for building, compiling and capturing its model)."""
    target = random_target(run.shape)
    if run.quantization:
        target.quantize(run.quantization)
    plan = plan_for(target, run.batches, run.contexts, run.new_tokens, run.k, run.kv_cache_fraction,
                    run.max_prefill_tokens)
    results["kv_pool"] = {"num_pages": plan.num_pages, "max_seq_len": plan.max_seq_len,
                          "budget_gib": round(plan.budget_bytes / GIB, 2)}
    log(f"target built; KV pool {plan.num_pages} pages, max_seq_len {plan.max_seq_len}, budget "
        f"{plan.budget_bytes / GIB:.1f} GiB")
    with tempfile.TemporaryDirectory() as workdir:
        for row in context_points(target, plan, run.batches, run.contexts, run.k, run.new_tokens, bandwidth,
                                  run.max_prefill_tokens, run.compile_step, workdir, run.kv_cache_dtypes):
            results["points"].append(row)
            save()
            log(format_point(row))


def _mode_name(p: dict) -> str:
    name = "no spec" if p["mode"] == "none" else f"EAGLE-3 ({p['forced_drafts']:g} drafts forced)"
    return name + (", FP8 KV" if p.get("kv_cache_dtype") == "fp8" else "")


def format_point(p: dict) -> str:
    head = f"{_mode_name(p):27s} batch {p['batch']:3d} context {p['context']:7d}"
    if p.get("skipped"):
        return f"{head}  skipped: {p['skipped']}"
    return (f"{head}  step {p['step_ms']:7.2f} ms  roofline {p['roofline_fraction']:6.1%}  prefill "
            f"{p['prefill_tokens_per_second']:9.0f} tok/s  TTFT {p['ttft_s']:.3f} s ({p['prefill_steps']} steps)")


def format_attention(a: dict) -> str:
    head = f"attention {a['backend']:10s} batch {a['batch']:3d} context {a['context']:7d}"
    if a.get("unavailable"):
        return f"{head}  unavailable: {a['unavailable']}"
    error = f"  max abs error {a['max_abs_error']:.2e}" if a.get("max_abs_error") is not None else ""
    return f"{head}  {a['us_per_call']:9.1f} us  roofline {a['roofline_fraction']:6.1%} ({a['timing']}){error}"


def table(results: dict) -> str:
    """Markdown tables of the decode points and the attention entries."""
    bandwidth = results["bandwidth_bytes_per_s"]["gemv"] / 1e12
    lines = [(f"{results['gpu']}, {results['shape']} random weights, bf16, K={results['k']}, "
              f"{results['new_tokens']} new tokens, {results['date']}; GEMV bandwidth {bandwidth:.2f} TB/s"),
             "| mode | batch | context | step ms | of roofline | prefill tok/s | TTFT s |",
             "|---|---|---|---|---|---|---|"]
    for p in sorted(results["points"], key=lambda p: (p["mode"], p["batch"], p["context"])):
        cells = ([f"skipped: {p['skipped']}", "", "", ""] if p.get("skipped") else
                 [f"{p['step_ms']:.2f}", f"{p['roofline_fraction']:.1%}", f"{p['prefill_tokens_per_second']:.0f}",
                  f"{p['ttft_s']:.3f}"])
        lines.append(f"| {_mode_name(p)} | {p['batch']} | {p['context']} | " + " | ".join(cells) + " |")
    if results.get("attention"):
        lines += ["", "| attention | batch | context | us / call | of roofline | max abs error |",
                  "|---|---|---|---|---|---|"]
        for a in results["attention"]:
            cells = ([f"unavailable: {a['unavailable']}", "", ""] if a.get("unavailable") else
                     [f"{a['us_per_call']:.1f}", f"{a['roofline_fraction']:.1%}",
                      f"{a['max_abs_error']:.2e}" if a.get("max_abs_error") is not None else "-"])
            lines.append(f"| {a['backend']} | {a['batch']} | {a['context']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_context(results: dict, path: str | Path) -> Path | None:
    """Roofline fraction against context (log2 axis): one line per (batch, mode[, attention backend]) and, when
    the run has attention entries, a second panel with one line per (backend, batch). None (and no file)
    without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    attention = [a for a in results.get("attention", []) if a.get("us_per_call") is not None]
    fig = Figure(figsize=(6.4 * (1 + bool(attention)), 4.4))
    axes = fig.subplots(1, 1 + bool(attention), squeeze=False)[0]
    points = [p for p in results["points"] if not p.get("skipped")]
    _lines(axes[0], points, lambda p: (p["batch"], _mode_name(p), p.get("attention_backend")),
           lambda key: f"batch {key[0]}, {key[1]}" + (f", {key[2]}" if key[2] else ""))
    axes[0].set_title("decode step")
    if attention:
        _lines(axes[1], attention, lambda a: (a["backend"], a["batch"]), lambda key: f"{key[0]}, batch {key[1]}")
        axes[1].set_title(f"attention alone (verify: {attention[0].get('query_len', 4)} queries a request)")
    fig.suptitle(f"{results['gpu']} — {results['shape']} bf16, K={results['k']}, memory roofline at "
                 f"{results['bandwidth_bytes_per_s']['gemv'] / 1e12:.2f} TB/s ({results['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)


def _lines(ax, rows: list[dict], key, label) -> None:
    for group in dict.fromkeys(key(r) for r in rows):
        mine = sorted((r for r in rows if key(r) == group), key=lambda r: r["context"])
        ax.plot([r["context"] for r in mine], [r["roofline_fraction"] for r in mine], "o-", label=label(group))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("fraction of the memory roofline")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=7)
