"""The server against offline decoding on one model: random weights of a named shape (no download), acceptance
forced, the same random prompts offline (``generate``) and through the OpenAI server (a real uvicorn server in
this process, the load generator ``tllm-spec bench-serve`` in a child process so that neither steals the
other's interpreter).

Reported: offline step time, tokens per step and their ratio (the time per output token a lone stream can
reach) at a concurrency's batch; offline generate() throughput over the same prompts the server serves (with
max_batch_size = the concurrency, so requests join as others finish, as on the server) and over one batch of
``concurrency`` prompts at once; the server's TPOT and output throughput at each concurrency, with the ratios the
serving targets name (``server_over_offline_throughput``: the same prompts).
"""
from __future__ import annotations

import contextlib
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from ..config import SamplingParams
from ..engine.step_log import StepLog
from ..sampling import flashinfer_ops
from ..spec_model import SpecModel
from .bench_datasets import random_prompts
from .benchmark import force_acceptance
from .random_models import SHAPES, random_spec_model
from .serving_harness import bench_serve_child, numbered_tokenizer, serve_in_thread


def offline(model: SpecModel, prompts: list[list[int]], output_len: int, out: Path | None = None,
            repeats: int = 1) -> dict:
    """generate() over ``prompts`` at once (ignore_eos, ``output_len`` tokens each): output tokens per second, of
    the median of ``repeats`` timed calls (each call's in ``runs_tokens_per_second``); with ``out``, that call's
    engine steps too (:func:`logging_steps`)."""
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    model.generate(prompts, params)  # warm: graphs of this batch size
    runs = []
    for r in range(repeats):
        start = time.perf_counter()
        log = out if out is None or repeats == 1 else out.with_name(f"{out.stem}-run{r}.json")
        with logging_steps(model, log) as steps:
            outs = model.generate(prompts, params)
        runs.append((time.perf_counter() - start, outs, steps))
    seconds, outs, steps = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
    tokens = sum(len(o.token_ids) for o in outs)
    step_ms, per_step = outs.stats["step_ms"], outs.stats["mean_accepted_length"]
    return {"prompts": len(prompts), "output_tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
            "step_ms": step_ms, "tokens_per_step": per_step, "step_ms_per_token": step_ms / per_step, **steps,
            "runs_tokens_per_second": [tokens / run[0] for run in runs]}


@contextlib.contextmanager
def logging_steps(model: SpecModel, out: Path | None):
    """Record the engine's steps meanwhile (StepLog) into ``out`` (JSON); yields a dict that gets their summary
    under "steps". Nothing with ``out`` None."""
    found: dict = {}
    if out is None:
        yield found
        return
    log = StepLog()
    model.loop.call(lambda: setattr(model.engine, "step_log", log))
    try:
        yield found
    finally:
        model.loop.call(lambda: setattr(model.engine, "step_log", None))
        found["steps"] = log.summary()
        out.write_text(json.dumps(log.as_dicts()))


def bench_serve(url: str, concurrency: int, num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                out_dir: Path, name: str | None = None) -> dict:
    """``tllm-spec bench-serve`` in a child process; its JSON report."""
    flags = ["--concurrency", str(concurrency), "--num-prompts", str(num_prompts), "--random-input-len", str(input_len),
             "--output-len", str(output_len), "--vocab-size", str(vocab_size)]
    return bench_serve_child(url, flags, out_dir / (name or f"concurrency-{concurrency}"))


def run(shape: str, forced: float, concurrencies: list[int], num_prompts: int, input_len: int, output_len: int,
        out_dir: Path, device: str = "cuda", delay_factors: list[float] | None = None, loop: str = "auto",
        repeats: int = 1) -> dict:
    """Offline, then the server, per concurrency (the offline batch: the first ``concurrency`` prompts, the batch
    the server keeps running) and per ``scheduler_delay_factor`` (default: the engine's); results in
    ``out_dir/serving_vs_offline.json`` (written after each point). With ``repeats``, each timed run (offline of
    the same prompts, and the server's) runs that many times and the median one is reported (the server's by
    output throughput; every run's in ``server_runs``): arrivals that happen to bunch differently make single
    runs of the server vary by several percent."""
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = AutoConfig.for_model("llama", **SHAPES[shape]).vocab_size  # as random_spec_model builds it
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = random_spec_model(shape, "eagle3", 3, tempfile.mkdtemp(), dtype, device,
                              max_batch_size=max(concurrencies), tokenizer=numbered_tokenizer(vocab))
    force_acceptance(model, forced)
    flashinfer_ops.wait_sampling_build()  # no timing shares the host with FlashInfer's JIT build
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    result: dict = {"shape": shape, "forced": forced, "device": gpu, "input_len": input_len, "output_len": output_len,
                    "uvicorn_loop": loop, "points": []}
    server, url = serve_in_thread(model, shape, loop)
    factors = delay_factors or [model.engine.admission.delay_factor]
    for c in concurrencies:
        prompts = random_prompts(num_prompts if c > 1 else max(8, num_prompts // 8), input_len, vocab, seed=0)
        ref = offline(model, prompts[:c], output_len)  # the batch the server keeps running at this concurrency
        same = offline(model, prompts, output_len, out_dir / f"steps-offline-{len(prompts)}.json", repeats) \
            if c == max(concurrencies) else None  # c requests at a time
        for factor in factors:
            model.loop.call(lambda f=factor: setattr(model.engine.admission, "delay_factor", f))
            bench_serve(url, c, c, input_len, output_len, vocab, out_dir, "warmup")  # first-time costs, not timed
            name = f"concurrency-{c}" if len(factors) == 1 else f"concurrency-{c}-delay-{factor:g}"
            runs = []
            for r in range(repeats):
                run_name = name if repeats == 1 else f"{name}-run{r}"
                with logging_steps(model, out_dir / f"steps-{run_name}.json") as steps:
                    report = bench_serve(url, c, len(prompts), input_len, output_len, vocab, out_dir, run_name)
                runs.append({**report["summary"], **steps})
            runs.sort(key=lambda run: run["output_throughput"])
            summary = runs[len(runs) // 2]
            point = {"concurrency": c, "scheduler_delay_factor": factor, "offline": ref, "server": summary,
                     "server_runs": [{"output_throughput": run["output_throughput"], "tpot_ms": run["tpot_ms"]["mean"],
                                      "ttft_ms_p99": run["ttft_ms"]["p99"], "steps": run.get("steps")} for run in runs],
                     "server_tpot_over_offline_step_per_token": summary["tpot_ms"]["mean"] / ref["step_ms_per_token"],
                     "server_over_offline_one_batch_throughput": summary["output_throughput"]
                     / ref["tokens_per_second"]}
            if same is not None:
                point["offline_same_prompts"] = same
                point["server_over_offline_throughput"] = summary["output_throughput"] / same["tokens_per_second"]
            result["points"].append(point)
            print(json.dumps({k: v for k, v in result["points"][-1].items() if k != "server"}), flush=True)
            (out_dir / "serving_vs_offline.json").write_text(json.dumps(result, indent=1))
    server.should_exit = True
    return result
