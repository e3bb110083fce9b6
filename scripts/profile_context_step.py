"""Where the time of a step with prompt tokens goes (the eager step a request's admission runs), beside the
graphed generation step: wall time per step, host time to launch it, GPU kernel time, and the top host ops and
kernels (torch profiler).

    python scripts/profile_context_step.py --shape llama-3.1-8b --prompt-len 128 --batches 1 8 --running 63
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from tllm_spec.config import SamplingParams
from tllm_spec.sampling import flashinfer_ops
from tllm_spec.tools.benchmark import force_acceptance
from tllm_spec.tools.random_models import SHAPES, random_spec_model


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _top(prof, steps: int, device: bool, n: int = 18) -> list[str]:
    rows = []
    for e in prof.key_averages():
        us = e.device_time_total if device else e.self_cpu_time_total
        if (device and e.device_type != DeviceType.CUDA) or not us:
            continue
        rows.append((us / steps, e.count // steps, e.key[:100]))
    return [f"{us / 1e3:8.3f} ms x{c:<5d} {k}" for us, c, k in sorted(rows, reverse=True)[:n]]


def timed_step(engine) -> float:
    """One engine step, milliseconds from launch to its outputs read."""
    _sync()
    start = time.perf_counter()
    engine.step()
    _sync()
    return (time.perf_counter() - start) * 1e3


def on_engine(model, fn):
    """``fn(engine)`` on this thread (the engine's own thread never starts: nothing is posted to it), one step per
    ``engine.step()``, outputs dropped."""
    engine = model.engine
    engine.on_output, engine.should_yield = (lambda out: None), (lambda: True)
    engine.admission.window = engine.admission.delay_factor = 0.0  # every added request joins the next step
    with torch.inference_mode():
        return fn(engine)


def time_context_steps(model, batch: int, prompt_len: int, repeats: int = 5) -> dict:
    """One step over ``batch`` new prompts (the admission step: prompt tokens only), timed and profiled."""
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    prompts = [[(7 * b + i) % 1000 + 1 for i in range(prompt_len)] for b in range(batch)]

    def step(engine):
        for b, prompt in enumerate(prompts):
            engine.add(b, prompt, params)
        return timed_step(engine)

    def measure(engine):
        step(engine)
        times = [step(engine) for _ in range(repeats)]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(engine)
        return times, prof

    times, prof = on_engine(model, measure)
    kernel_us = sum(e.device_time_total for e in prof.key_averages() if e.device_type == DeviceType.CUDA)
    return {"batch": batch, "prompt_len": prompt_len, "step_ms": sorted(times)[len(times) // 2],
            "kernel_ms": kernel_us / 1e3, "top_host": _top(prof, 1, device=False),
            "top_kernels": _top(prof, 1, device=True)}


def host_profile(fn, lines: int = 30) -> tuple[object, str]:
    """``fn()`` under cProfile: its result and the top ``lines`` functions by own time (where a step's host time
    goes: Python, kernel launches, synchronisations)."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        result = fn()
    finally:
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(lines)
    return result, text.getvalue()


def time_mixed_step(model, running: int, prompt_len: int, new_tokens: int = 64, cprofile: bool = False) -> dict:
    """Engine steps with ``running`` generating requests: plain steps, then a step that also admits one prompt
    (with ``cprofile``, that step's host functions by own time are in ``host_profile``)."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    prompts = [[(5 * b + i) % 1000 + 1 for i in range(prompt_len)] for b in range(running + 1)]

    def run(engine):
        for b in range(running):
            engine.add(b, prompts[b], params)
        engine.step()  # their prefill
        times = [timed_step(engine) for _ in range(6)]
        engine.add(running, prompts[running], params)
        mixed, host = host_profile(lambda: timed_step(engine)) if profiled else (timed_step(engine), None)
        after = [timed_step(engine) for _ in range(2)]
        for r in list(engine.running):
            engine.abort(r.request_id)
        engine.step()
        return {"running": running, "generation_steps_ms": times, "mixed_step_ms": mixed, "after_ms": after,
                **({"host_profile": host} if host else {})}

    profiled = False
    on_engine(model, run)  # warm: the mixed shapes
    profiled = cprofile
    return on_engine(model, run)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--running", type=int, default=63)
    p.add_argument("--forced", type=float, default=2.5)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--cprofile", action="store_true", help="the mixed step's host time by function (cProfile)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    longest = args.prompt_len * max(args.batches)
    model = random_spec_model(args.shape, "eagle3", 3, tempfile.mkdtemp(),
                              torch.bfloat16 if args.device == "cuda" else torch.float32, args.device,
                              max_batch_size=max(args.running + 1, *args.batches), compile_step=not args.no_compile,
                              max_seq_len=args.prompt_len + 64, max_num_batched_tokens=max(8192, longest))
    force_acceptance(model, args.forced)
    flashinfer_ops.wait_sampling_build()  # no timing shares the host with FlashInfer's JIT build
    for batch in args.batches:
        r = time_context_steps(model, batch, args.prompt_len)
        print(json.dumps({k: v for k, v in r.items() if not k.startswith("top")}))
        print("  host (self cpu):\n    " + "\n    ".join(r["top_host"]))
        print("  kernels:\n    " + "\n    ".join(r["top_kernels"]))
    if args.running:
        mixed = time_mixed_step(model, args.running, args.prompt_len, cprofile=args.cprofile)
        host = mixed.pop("host_profile", None)
        print(json.dumps(mixed))
        if host:
            print(host)


if __name__ == "__main__":
    main()
