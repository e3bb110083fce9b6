"""Prefix caching on against off, on one model and one server: random weights of a named shape (no download), an
EAGLE-3 head with acceptance forced, the OpenAI server in this process and ``tllm-spec bench-serve`` in a child
process (tools/serving_harness.py). Each workload runs with the cache on, then off: the engine's
``prefix_cache.enabled`` is toggled while it is idle and the cache is forgotten before each run, so both start
cold.

Workloads (bench_datasets.py): ``shared-prefix``, a long system prompt shared by every request and a distinct
question each; ``multi-turn``, conversations whose every turn resends the conversation so far.

Reported per workload: each run's bench-serve summary (TTFT / TPOT / E2E percentiles, output throughput), the hit
rate (cached prompt tokens over prompt tokens: the server's usage where it reports cached tokens, else the engine's
counter over the run) against the ideal, and the targets: TTFT p50 on / off <= 0.25, output throughput on / off
>= 1.3 (shared-prefix) or 1.5 (multi-turn), cached tokens short of the ideal by at most one page per request.

The ideal is what a perfect cache would serve, each request's share floored to whole pages and leaving its last
prompt token to compute: shared-prefix, the prefix for every request but the first one sent (requests admitted in
the same step as the first cannot share pages it has not written yet); multi-turn, from the second turn on, the
previous turn's prompt and completion (the engine caches prompt pages only: ``ideal_prompt_pages_tokens`` is the
previous prompt alone, what a cache of prompt pages can reach). A drafter that reads ahead (an EAGLE-3 head's K/V
at position p reads token p + 1) cannot share the page that ends where two prompts part: up to a page a request
less than the ideal. ``requests_more_than_a_page_short`` counts the requests that got less than that (from the
usage's cached tokens; None when the server does not report them).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..sampling import flashinfer_ops
from ..spec_model import SpecModel
from .benchmark import force_acceptance
from .random_models import random_spec_model, shape_config
from .serving_harness import bench_serve_child, numbered_tokenizer, serve_in_thread

TTFT_TARGETS = {"shared-prefix": 0.25}  # TTFT p50 with the cache on over off, at most (multi-turn: reported)
THROUGHPUT_TARGETS = {"shared-prefix": 1.3, "multi-turn": 1.5}  # output throughput on over off, at least
PAGES_SHORT_TARGET = 1.0  # cached tokens short of the ideal, in pages a request, at most


class Workload(BaseModel):
    """One bench-serve load (``tllm-spec bench-serve --dataset ...``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dataset: Literal["shared-prefix", "multi-turn"]
    num_prompts: int = Field(ge=1, description="requests (multi-turn: conversations)")
    concurrency: int = Field(ge=1, description="requests (multi-turn: conversations) in flight")
    question_len: int = Field(ge=1, description="tokens of each question (multi-turn: words, a token each here)")
    output_len: int = Field(ge=1, description="tokens generated per request")
    shared_prefix_len: int = Field(0, ge=0, description="shared-prefix: tokens of the shared prefix")
    turns: int = Field(1, ge=1, description="multi-turn: requests per conversation")

    def flags(self, vocab_size: int, seed: int) -> list[str]:
        """Its bench-serve flags."""
        flags = ["--dataset", self.dataset, "--num-prompts", str(self.num_prompts), "--concurrency",
                 str(self.concurrency), "--question-len", str(self.question_len), "--output-len",
                 str(self.output_len), "--vocab-size", str(vocab_size), "--seed", str(seed)]
        if self.dataset == "shared-prefix":
            return [*flags, "--shared-prefix-len", str(self.shared_prefix_len)]
        return [*flags, "--turns", str(self.turns)]

    def warmup(self) -> Workload:
        """A short load of the same shapes (a request per concurrency slot; two turns): first-time costs."""
        return self.model_copy(update={"num_prompts": self.concurrency, "turns": min(self.turns, 2)})


def workloads(names: tuple[str, ...] = ("shared-prefix", "multi-turn"), concurrency: int = 16,
              num_prompts: int = 256, shared_prefix_len: int = 4096, question_len: int = 128, output_len: int = 128,
              turns: int = 8, num_conversations: int = 32) -> list[Workload]:
    """The named workloads; the defaults are the targets' (256 requests each: 32 conversations of 8 turns)."""
    common = {"concurrency": concurrency, "question_len": question_len, "output_len": output_len}
    every = {"shared-prefix": Workload(dataset="shared-prefix", num_prompts=num_prompts,
                                       shared_prefix_len=shared_prefix_len, **common),
             "multi-turn": Workload(dataset="multi-turn", num_prompts=num_conversations, turns=turns, **common)}
    return [every[name] for name in names]


def set_prefix_caching(model: SpecModel, enabled: bool) -> None:
    """Turn the engine's prefix cache on or off and forget the pages it holds (on the engine's thread, between
    steps; call it while no request runs)."""
    def toggle() -> None:
        model.engine.prefix_cache.enabled = enabled
        model.engine.prefix_cache.reset()

    model.loop.call(toggle)


def engine_cached_tokens(model: SpecModel) -> int:
    """The engine's count of prompt tokens served from the prefix cache so far."""
    return model.loop.call(lambda: model.engine.prefix_cache.hits)


def ideal_per_request(requests: list[dict], workload: Workload, page_size: int,
                      outputs: bool = True) -> list[tuple[dict, int]]:
    """(record, prompt tokens a perfect prefix cache would serve it) of each completed request of ``requests``
    (bench-serve's records): its share floored to pages, leaving its last prompt token to compute (see the
    module's docstring); ``outputs`` False: a multi-turn turn reuses the previous prompt only."""
    def pages(num_tokens: int, r: dict) -> int:
        return min(num_tokens, r["prompt_tokens"] - 1) // page_size * page_size

    done = sorted((r for r in requests if r["ok"] and r["prompt_tokens"]), key=lambda r: r["start"])
    if workload.dataset == "shared-prefix":
        return [(r, pages(workload.shared_prefix_len, r) if i else 0) for i, r in enumerate(done)]
    turns = {(r["conversation"], r["turn"]): r for r in requests}
    previous = [(turns.get((r["conversation"], r["turn"] - 1)), r) for r in done]
    return [(r, pages(p["prompt_tokens"] + (p["output_tokens"] if outputs else 0), r)
             if p is not None and p["ok"] and p["prompt_tokens"] else 0) for p, r in previous]


def measure(model: SpecModel, url: str, workload: Workload, enabled: bool, out: Path, vocab_size: int, seed: int,
            page_size: int) -> dict:
    """One bench-serve run with the cache on or off (forgotten first): its summary, the hit rate and the ideal."""
    set_prefix_caching(model, enabled)
    before = engine_cached_tokens(model)
    report = bench_serve_child(url, workload.flags(vocab_size, seed), out)
    engine_cached = engine_cached_tokens(model) - before
    summary, requests = report["summary"], report["requests"]
    usage_cached = summary["num_cached_tokens"]
    cached = engine_cached if usage_cached is None else usage_cached
    prompt = summary["num_prompt_tokens"] or 0
    ideal = ideal_per_request(requests, workload, page_size)
    num_ideal = sum(n for _, n in ideal)
    short = [n - r["cached_tokens"] > page_size for r, n in ideal if r["cached_tokens"] is not None]
    return {"cache": "on" if enabled else "off", "summary": summary, "num_prompt_tokens": prompt,
            "cached_tokens": cached, "cached_tokens_from": "engine" if usage_cached is None else "usage",
            "engine_cached_tokens": engine_cached, "hit_rate": cached / prompt if prompt else 0.0,
            "usage_hit_rate": summary["prefix_cache_hit_rate"], "ideal_cached_tokens": num_ideal,
            "ideal_hit_rate": num_ideal / prompt if prompt else 0.0,
            "ideal_prompt_pages_tokens": sum(n for _, n in ideal_per_request(requests, workload, page_size, False)),
            "pages_short_per_request": (num_ideal - cached) / page_size / max(1, len(ideal)),
            "requests_more_than_a_page_short": sum(short) if short else None}


def verdict(workload: Workload, on: dict, off: dict) -> dict:
    """The ratios of the cache-on run over the cache-off run and whether each target is met."""
    ttft = on["summary"]["ttft_ms"]["p50"] / off["summary"]["ttft_ms"]["p50"]
    throughput = on["summary"]["output_throughput"] / off["summary"]["output_throughput"]
    short, target = on["pages_short_per_request"], THROUGHPUT_TARGETS[workload.dataset]
    targets = {"output_throughput_on_over_off": {"at_least": target, "met": throughput >= target},
               "pages_short_per_request": {"at_most": PAGES_SHORT_TARGET, "met": short <= PAGES_SHORT_TARGET}}
    if workload.dataset in TTFT_TARGETS:
        at_most = TTFT_TARGETS[workload.dataset]
        targets["ttft_p50_on_over_off"] = {"at_most": at_most, "met": ttft <= at_most}
    return {"ttft_p50_on_over_off": ttft, "output_throughput_on_over_off": throughput,
            "pages_short_per_request": short, "targets": targets}


def run(loads: list[Workload], out_dir: Path, shape: str = "llama-3.1-8b", forced: float = 2.5,
        device: str = "cuda", max_draft_len: int = 3, seed: int = 0, warmup: bool = True) -> dict:
    """Each workload with the cache on, then off (after a warm-up of its shapes, other prompts, when ``warmup``);
    results in ``out_dir/prefix_cache_bench.json`` (written after each workload), bench-serve's reports in
    ``out_dir/<dataset>-on`` and ``-off``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = shape_config(shape).vocab_size
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = random_spec_model(shape, "eagle3", max_draft_len, tempfile.mkdtemp(), dtype, device,
                              max_batch_size=max(w.concurrency for w in loads),
                              tokenizer=numbered_tokenizer(vocab_size), enable_prefix_caching=True)
    force_acceptance(model, forced)
    flashinfer_ops.wait_sampling_build()  # no timing shares the host with FlashInfer's JIT build
    page_size = model.loop.call(lambda: model.engine.prefix_cache.page_size)
    result: dict = {"shape": shape, "forced": forced, "max_draft_len": max_draft_len, "page_size": page_size,
                    "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "workloads": []}
    server, url = serve_in_thread(model, shape)
    try:
        for load in loads:
            if warmup:
                set_prefix_caching(model, True)
                bench_serve_child(url, load.warmup().flags(vocab_size, seed + 1), out_dir / f"{load.dataset}-warmup")
            on = measure(model, url, load, True, out_dir / f"{load.dataset}-on", vocab_size, seed, page_size)
            off = measure(model, url, load, False, out_dir / f"{load.dataset}-off", vocab_size, seed, page_size)
            result["workloads"].append({"workload": load.model_dump(), "on": on, "off": off,
                                        **verdict(load, on, off)})
            (out_dir / "prefix_cache_bench.json").write_text(json.dumps(result, indent=1))
    finally:
        server.should_exit = True
        model.close()
    return result


def format_table(result: dict) -> str:
    """A row per run (throughput, latencies in ms, hit rate and the ideal), then each workload's targets."""
    head = (f"{'workload':<14} {'cache':<5} {'ok/fail':>8} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'TPOT p50':>9} {'E2E p50':>9} {'hit':>6} {'ideal':>6}")
    rows = [_row(entry["workload"]["dataset"], run_) for entry in result["workloads"]
            for run_ in (entry["on"], entry["off"])]
    return "\n".join([head, *rows, "", *(_targets(entry) for entry in result["workloads"])])


def _row(name: str, run_: dict) -> str:
    s = run_["summary"]
    return (f"{name:<14} {run_['cache']:<5} {s['num_completed']:>4}/{s['num_failed']:<3} {s['output_throughput']:8.1f} "
            f"{s['ttft_ms']['p50']:9.1f} {s['ttft_ms']['p99']:9.1f} {s['tpot_ms']['p50'] or 0:9.2f} "
            f"{s['e2e_ms']['p50']:9.1f} {run_['hit_rate']:6.1%} {run_['ideal_hit_rate']:6.1%}")


def _targets(entry: dict) -> str:
    met = {name: "met" if target["met"] else "MISSED" for name, target in entry["targets"].items()}
    on = entry["on"]
    short, prompt_pages = on["requests_more_than_a_page_short"], on["ideal_prompt_pages_tokens"]
    ttft = entry["targets"].get("ttft_p50_on_over_off")
    ttft_target = "" if ttft is None else f" (<= {ttft['at_most']}x: {met['ttft_p50_on_over_off']})"
    return (f"{entry['workload']['dataset']}: TTFT p50 on/off {entry['ttft_p50_on_over_off']:.3f}x{ttft_target}; "
            f"output throughput on/off "
            f"{entry['output_throughput_on_over_off']:.2f}x (>= "
            f"{entry['targets']['output_throughput_on_over_off']['at_least']}x: "
            f"{met['output_throughput_on_over_off']}); cached {entry['pages_short_per_request']:.2f} pages a request "
            f"short of the ideal (<= {PAGES_SHORT_TARGET:g}: {met['pages_short_per_request']}; "
            f"{'?' if short is None else short} of {on['summary']['num_completed']} requests more than a page short; "
            f"the ideal of a cache of prompt pages alone: {prompt_pages / max(1, on['num_prompt_tokens']):.1%})")
