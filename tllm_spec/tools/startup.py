"""Start-up time: from a fresh process to ready for every request, in a fresh cache directory and again in a
second process that finds the first one's caches; then whether serving compiles anything more.

The parent (:func:`run_startup`, ``scripts/benchmark.py --startup``) starts this module as a child process
twice with ``TLLM_SPEC_CACHE_DIR`` pointing at a new directory (Inductor's, Triton's and FlashInfer's caches all
under it, :mod:`tllm_spec.caches`). The child times its phases: interpreter and imports, building the model
(random weights of a named shape, an EAGLE-3 head), :meth:`SpecModel.warmup` (compiles, graph captures and
FlashInfer's sampling build); "ready" is the end of the warm-up. The JSON names the build's phases, torch.compile's
time by phase and when FlashInfer's background build began and ended. It then serves a batch mixing greedy, sampled and
seeded requests (and guided ones where llguidance is installed) at every batch bucket and counts what that
compiled or captured: a request path that compiles shows up as ``compiles_after_ready > 0`` (torch.compile) or
``triton_variants_after_ready > 0`` (a Triton kernel specialised anew). ``writes_bytecode``: whether the children
kept Python's bytecode (false under ``PYTHONDONTWRITEBYTECODE``, where every process compiles the source of every
module it imports: seconds of imports that a machine keeping ``__pycache__`` does not pay).
"""
from __future__ import annotations

import time

START = time.time()  # this module's start (the package, torch among its imports, was imported before it)

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from ..caches import CACHE_DIR_VAR, CACHE_VARS


def num_triton_variants(package: str = "tllm_spec") -> int | None:
    """Compiled variants of ``package``'s Triton kernels held in this process (a new specialisation on a request's
    path shows up here: a compile, or a load from the on-disk cache). None where Triton is missing or its
    internals differ."""
    try:
        from triton.runtime.jit import _triton_jit_function_registry as registry
        return sum(len(entry[0]) for fn in registry.values() if fn.module.startswith(package)
                   for entry in fn.device_caches.values())
    except (ImportError, AttributeError, TypeError, IndexError):
        return None


def dynamo_phase_seconds(at_least: float = 0.05) -> dict[str, float]:
    """torch.compile's time so far by phase (Dynamo's own aggregate: tracing, AOT, Inductor, cache loads), the
    phases of at least ``at_least`` seconds; what a warm-up's compile time is made of."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    return {name: round(float(v), 2) for name, v in zip(names, values) if float(v) >= at_least}


def mixed_params(size: int, guided: bool) -> list:
    """``size`` requests cycling through greedy, sampled, seeded sampled (and JSON-guided) parameters."""
    from ..config import SamplingParams

    kinds = [SamplingParams(max_new_tokens=8, ignore_eos=True),
             SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.9),
             SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, top_k=50, seed=7)]
    if guided:
        kinds.append(SamplingParams(max_new_tokens=8, guided_decoding={"json_schema": {"type": "object"}}))
    return [kinds[i % len(kinds)] for i in range(size)]


def child(shape: str, max_batch_size: int, device: str, out: Path) -> None:
    """Build, warm up, serve mixed batches at every bucket; write the timings and counts to ``out``."""
    imported = time.time()
    from ..engine.cuda_graphs import batch_buckets, num_compiled_graphs, variant_name
    from .random_models import random_spec_model

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    marks: dict[str, float] = {}
    model = random_spec_model(shape, "eagle3", 3, tempfile.mkdtemp(), dtype, device, marks=marks,
                              max_batch_size=max_batch_size)
    built = time.time()
    graphs = model.warmup()
    ready = time.time()
    compile_phases = dynamo_phase_seconds()
    compiles, captured, variants = num_compiled_graphs(), graphs, num_triton_variants()
    from torch._dynamo.utils import counters
    trace_cache = dict(counters["dynamo_cache"])  # traces loaded from disk (hits) or not found there (misses)
    guided = model.runner.enable_guided_decoding() is None if model.tokenizer is not None else False
    vocab = model.target.vocab_size
    for size in batch_buckets(max_batch_size):
        prompts = [[(31 * i + j) % vocab for j in range(16)] for i in range(size)]
        model.generate(prompts, mixed_params(size, guided))
    graph_runner = model.runner.graph_runner
    captures = [] if graph_runner is None else [
        {"batch": key[0], "draft_len": key[1], "variant": variant_name(key[3:]), "seconds": round(seconds, 2)}
        for key, seconds in graph_runner.capture_seconds.items()]
    from ..sampling.flashinfer_ops import sampling_build_times
    result = {"start": START, "imported": imported, **{f"{name}_built": t for name, t in marks.items()},
              **{f"flashinfer_build_{name}": t for name, t in sampling_build_times().items()},
              "built": built, "ready": ready, "compile_phases_s": compile_phases, "trace_cache": trace_cache,
              "graphs_at_ready": captured, "compiles_at_ready": compiles,
              "compiles_after_ready": num_compiled_graphs() - compiles,
              "captures_after_ready": (len(graph_runner.graphs) - captured) if graph_runner is not None else 0,
              "triton_variants_at_ready": variants,
              "triton_variants_after_ready": None if variants is None else num_triton_variants() - variants,
              "captures": captures, "guided_served": guided, "served_buckets": batch_buckets(max_batch_size),
              "writes_bytecode": not sys.flags.dont_write_bytecode}
    out.write_text(json.dumps(result, indent=1))


def run_child(shape: str, max_batch_size: int, device: str, cache_dir: Path, timeout_s: float) -> dict:
    """One child process with all caches under ``cache_dir``; its result plus ``ready_s`` (spawn to ready)."""
    env = _env_caching_in(cache_dir)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        spawned = time.time()
        subprocess.run([sys.executable, "-m", "tllm_spec.tools.startup", "--child", "--shape", shape,
                        "--max-batch-size", str(max_batch_size), "--device", device, "--out", str(out)],
                       env=env, check=True, timeout=timeout_s)
        result = json.loads(out.read_text())
    result["ready_s"] = result["ready"] - spawned
    marks = [("interpreter_and_imports", "imported"), ("build_target", "target_built"),
             ("write_draft_checkpoint", "draft_checkpoint_built"), ("build_spec_model", "built"), ("warmup", "ready")]
    result["phases_s"], last = {}, spawned
    for phase, mark in marks:
        if mark in result:
            result["phases_s"][phase], last = result[mark] - last, result[mark]
    if "flashinfer_build_ended" in result:  # the sampling JIT build (or cache load), beside the phases above
        result["flashinfer_build_s"] = {"began_after_spawn": result["flashinfer_build_began"] - spawned,
                                        "took": result["flashinfer_build_ended"] - result["flashinfer_build_began"]}
    return result


def run_startup(shape: str, max_batch_size: int, device: str, out: Path, gpu_tests: bool = False,
                timeout_s: float = 1800.0) -> dict:
    """Fresh process in a fresh cache directory, then a second process on the same caches; with ``gpu_tests``
    also the wall time of the GPU test suite from empty caches (:func:`time_gpu_tests`). Writes ``out`` (JSON)
    and returns it."""
    if sys.flags.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE"):
        warnings.warn("PYTHONDONTWRITEBYTECODE is set: every process compiles each imported module's source again "
                      "(seconds of a warm start), which a machine keeping __pycache__ does not", stacklevel=2)
    cache_dir = Path(tempfile.mkdtemp(prefix="tllm_spec_startup_cache_"))
    fresh = run_child(shape, max_batch_size, device, cache_dir, timeout_s)
    warm = run_child(shape, max_batch_size, device, cache_dir, timeout_s)
    result = {"shape": shape, "max_batch_size": max_batch_size, "device": _device_name(device),
              "date": time.strftime("%Y-%m-%d"), "fresh_ready_s": fresh["ready_s"], "warm_ready_s": warm["ready_s"],
              "compiles_after_ready": max(fresh["compiles_after_ready"], warm["compiles_after_ready"]),
              "captures_after_ready": max(fresh["captures_after_ready"], warm["captures_after_ready"]),
              "triton_variants_after_ready": fresh["triton_variants_after_ready"],
              "writes_bytecode": warm["writes_bytecode"],
              "gpu_test_suite_s": None, "gpu_test_suite_rc": None, "fresh": fresh, "warm": warm}
    if gpu_tests:
        result.update(time_gpu_tests(timeout_s))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot_startup(result, out.with_suffix(".png"))
    return result


TARGETS_S = {"fresh": 90.0, "warm": 20.0}  # start-up targets: one H200, the 8B shape, buckets 1-8


def plot_startup(result: dict, path: Path) -> bool:
    """The two processes' phases as stacked bars, spawn to ready, each beside its target; False (nothing written)
    where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 2.6))
    runs = ["warm", "fresh"]
    for row, run in enumerate(runs):
        left = 0.0
        for i, (phase, seconds) in enumerate(result[run]["phases_s"].items()):
            ax.barh(row, seconds, left=left, color=f"C{i}", label=phase.replace("_", " ") if row == 0 else None)
            left += seconds
        ax.text(left + 1, row, f"{left:.1f} s", va="center", fontsize=8)
        ax.plot([TARGETS_S[run]] * 2, [row - 0.4, row + 0.4], "k--", linewidth=1,
                label="target" if row == 0 else None)
    ax.set_yticks(range(len(runs)), ["second process", "fresh caches"])
    ax.set_xlabel("seconds from spawn to ready for every request")
    ax.set_title(f"start-up, {result['shape']}, buckets to {result['max_batch_size']}, {result['device']}, "
                 f"{result['date']}", fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def gpu_test_command() -> list[str]:
    """``pytest tests/gpu`` (failed tests named, ``-rf``), spread over four workers where pytest-xdist is installed
    (the README's command)."""
    try:
        import xdist  # noqa: F401
    except ImportError:
        return [sys.executable, "-m", "pytest", "-q", "-rf", "tests/gpu"]
    return [sys.executable, "-m", "pytest", "-q", "-rf", "-n", "4", "--dist", "worksteal", "tests/gpu"]


def time_gpu_tests(timeout_s: float) -> dict:
    """Wall time and exit status of :func:`gpu_test_command` in a new, empty cache directory (what a fresh
    machine pays: every compile and FlashInfer's JIT build), pytest's last line (its summary; stderr's warnings
    come before it) and the tests that failed."""
    env = _env_caching_in(tempfile.mkdtemp(prefix="tllm_spec_gpu_tests_cache_"))
    command, began = gpu_test_command(), time.time()
    try:
        done = subprocess.run(command, env=env, timeout=timeout_s, check=False, capture_output=True, text=True)
        rc, lines = done.returncode, (done.stderr + done.stdout).strip().splitlines()  # stdout last: the summary
    except subprocess.TimeoutExpired:
        rc, lines = None, ["timed out"]
    return {"gpu_test_suite_s": time.time() - began, "gpu_test_suite_rc": rc,
            "gpu_test_suite_command": " ".join(command[2:]), "gpu_test_suite_summary": lines[-1] if lines else "",
            "gpu_test_suite_failed": [line.split()[1] for line in lines if line.startswith("FAILED ")]}


def _env_caching_in(cache_dir: Path | str) -> dict[str, str]:
    """This process's environment with every compile cache under ``cache_dir`` (its own cache variables dropped)."""
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARS}
    env[CACHE_DIR_VAR] = str(cache_dir)
    return env


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else device


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help="(internal) the measured process")
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("--gpu-tests", action="store_true")
    args = p.parse_args(argv)
    if args.child:
        child(args.shape, args.max_batch_size, args.device, Path(args.out))
    else:
        print(json.dumps(run_startup(args.shape, args.max_batch_size, args.device, Path(args.out), args.gpu_tests),
                         indent=1))


if __name__ == "__main__":
    main()
