"""Decode speed of one-model speculative decoding vs plain decoding, the memory roofline and HF generate.

Random-weight target of a named shape and a random EAGLE-3 head (no download), or a random draft LM
(--draft-shape), or a random MTP module (--mtp), or suffix-automaton drafting (--sa); acceptance is set with
TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS. Writes JSON and a plot.

    python scripts/benchmark.py --shape llama-3.1-8b --batches 1 4 16 64 --out runs/bench
    python scripts/benchmark.py --shape qwen3-30b-a3b --batches 1 8 --forced 0 3   # MoE: distinct experts counted
    python scripts/benchmark.py --tree default --batches 1 8 32 --forced 3 --no-hf   # the default static tree
    python scripts/benchmark.py --draft-shape llama-3.2-1b --batches 1 8 --forced 3 --no-hf   # a 1B draft LM
    python scripts/benchmark.py --sa -k 8 --batches 1 --forced 8 --no-hf   # suffix drafting, 8 drafts
    torchrun --nproc-per-node 2 scripts/benchmark.py --tensor-parallel-size 2 --shape glm-4.5-air --mtp \
        --batches 1 8 --forced 0 1.5 3 --no-hf   # MTP-Eagle, -k drafts from one random MTP module
    python scripts/benchmark.py --plot-only runs/bench/benchmark.json
    torchrun --nproc-per-node 2 scripts/benchmark.py --tensor-parallel-size 2 --shape llama-3.1-70b --no-hf
    python scripts/benchmark.py --context 2048 8192 32768 --batches 1 8 --attention-backends old split flashinfer xqa
    python scripts/benchmark.py --startup --batches 8 --out docs/benchmarks --startup-name h200-llama-3.1-8b-startup

--startup: start-up time instead (tllm_spec/tools/startup.py): spawn to ready for every request (warm-up of every
bucket up to the largest --batches, greedy, sampled and seeded) in a fresh cache directory and again in a second
process, and what serving mixed batches at every bucket compiled after that; --gpu-tests also times pytest tests/gpu
(four xdist workers where pytest-xdist is installed) from empty caches. Writes <--out>/<--startup-name>.json and
a plot of the phases (.png).

--context: long-context decoding instead (step time against the roofline, prefill tokens/s and TTFT per batch
size, context and mode: no speculation, EAGLE-3 with K of K drafts forced) and, with --attention-backends, the
verify step's attention alone per backend; writes context.json and context.png into --out.

Mixture-of-experts shapes (qwen3-30b-a3b, glm-4.5-air, mixtral-8x7b): the roofline reads the non-expert weights once
and, per MoE layer, the distinct experts the step's tokens were routed to, counted in an eager rerun of each point
(same prompts, forcing and seed): each point's distinct_experts_per_layer and expert_bytes_per_step. HF generate
runs once per --hf-experts implementation (eager: transformers' stock loop over experts); every point and HF row
says in ``path`` what ran.

Tensor parallel: every rank runs the same schedule; rank 0 writes the results. The roofline is per GPU (this
rank's weight and KV bytes over one GPU's bandwidth; communication is not in it).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tllm_spec.distributed.parallel import local_process_device
from tllm_spec.drafts.tree import DEFAULT_EAGLE_CHOICES
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.benchmark import (
    engine_path,
    force_acceptance,
    format_profile,
    measure_bandwidth,
    profile_step,
    run_point,
    sweep_draft_len,
    to_rows,
)
from tllm_spec.tools.benchmark_report import plot, table
from tllm_spec.tools.context_report import (
    add_context_arguments,
    check_context_arguments,
    context_run,
    plot_context,
    run_context_benchmark,
)
from tllm_spec.tools.hf_generate import hf_generate_row
from tllm_spec.tools.random_models import SHAPES, is_moe_shape, random_spec_model
from tllm_spec.tools.routing import moe_summary
from tllm_spec.tools.startup import plot_startup, run_startup


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("-k", "--max-draft-len", type=int, default=3)
    p.add_argument("--tree", nargs="?", const="default", help="the head drafts a static tree: 'default' "
                   "(DEFAULT_EAGLE_CHOICES) or eagle_choices as JSON; -k becomes its depth (forced acceptance "
                   "follows its most likely children)")
    p.add_argument("--dynamic-tree", type=int, nargs=3, metavar=("TOPK", "DRAFTS", "DEPTH"),
                   help="the head grows a dynamic tree (a random head's trees are shallow: forced acceptance "
                   "stops at the depth they reach)")
    p.add_argument("--draft-shape", choices=sorted(s for s in SHAPES if not is_moe_shape(s)),
                   help="speculate with a random draft LM of this shape (DraftTargetConfig, e.g. llama-3.2-1b for the "
                   "8B target) instead of an EAGLE-3 head")
    p.add_argument("--sa", action="store_true", help="speculate with suffix-automaton drafting (SAConfig, -k drafts) "
                   "instead of an EAGLE-3 head")
    p.add_argument("--mtp", action="store_true", help="speculate with one random MTP module of the target's layer "
                   "class (MTP-Eagle: -k drafts from module 0; any shape) instead of an EAGLE-3 head")
    p.add_argument("--sa-spec", action="store_true", help="the EAGLE-3 head with use_sa_spec (the automaton's drafts "
                   "where the text repeats)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--forced", type=float, nargs="+", help="forced accepted drafts (default 0..K and 1.5; 0 means off, as in TensorRT-LLM: the draft's own acceptance, ~0 drafts for random heads)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--hf-static-batches", type=int, nargs="*", default=[1], help="HF static-cache baseline here")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--hf-experts", nargs="+", choices=["eager", "grouped_mm", "batched_mm"],
                   default=["eager", "grouped_mm"], help="MoE shapes: HF generate with each of these transformers "
                   "experts implementations (eager: the stock loop over experts; grouped_mm: transformers' default)")
    p.add_argument("--compare-eager", action="store_true",
                   help="also measure no-spec and EAGLE-3 forced K with the stock HF layers (graphed, not compiled; "
                   "eager steps for MoE shapes, whose stock expert loop no graph can capture) "
                   "and with fused layers not compiled, on fresh targets: the gain of each step of the fast path")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="split the target over N GPUs (torchrun "
                   "--nproc-per-node N); HF generate is then skipped")
    p.add_argument("--tp-all-reduce", choices=["auto", "one_shot", "nccl"], default="auto",
                   help="EngineConfig.tp_all_reduce: a step's all-reduces through tllm_spec's Lamport kernel (auto), "
                   "torch's one-shot kernel, or NCCL")
    p.add_argument("--tp-draft", choices=["auto", "replicated", "sharded"], default="auto",
                   help="EngineConfig.tp_draft: the EAGLE-3 head split like the target where it can be (auto), whole "
                   "on every rank, or split")
    p.add_argument("--profile", action="store_true", help="kernel-time breakdown of the graphed step at "
                   "--profile-batch (TLLM_SPEC_DEPENDENT_LAUNCH=0: each kernel's own time, no programmatic dependent "
                   "launch)")
    p.add_argument("--profile-batch", type=int, default=1, help="the batch size --profile breaks down")
    p.add_argument("--draft-len-sweep", action="store_true", help="measure every draft length 0..K at every batch "
                   "size with a realistic forced acceptance and print the fastest as a draft_len_schedule")
    p.add_argument("--sweep-acceptance", type=float, default=0.7, help="per-draft acceptance rate of the sweep: "
                   "k drafts accept sum_i a^i on average (0.7 gives 1.53 of 3)")
    p.add_argument("--quantization", choices=["fp8"], help="the target quantized online (random weights, per-channel "
                   "FP8, dynamic per-token activations; the head stays bf16), measured beside the bf16 target in "
                   "the same run (its plain points at every batch, EAGLE-3 at K of K forced); with --context the "
                   "target of every point (no bf16 target beside)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="fp8: the KV pool in E4M3 "
                   "(scales 1.0), measured beside a bf16 pool in the same run (with --quantization: the bf16 "
                   "variant has both); with --context each point with each pool")
    p.add_argument("--out", default="runs/benchmark")
    p.add_argument("--plot-only", help="re-plot an earlier benchmark.json (or context.json, or a start-up JSON)")
    add_context_arguments(p)
    startup = p.add_argument_group("start-up (--startup)")
    startup.add_argument("--startup", action="store_true", help="measure start-up time instead (see above)")
    startup.add_argument("--startup-name", default="startup", help="the JSON's name under --out")
    startup.add_argument("--gpu-tests", action="store_true", help="also time pytest tests/gpu from empty caches")
    args = p.parse_args()
    check_context_arguments(p, args)
    if args.context and is_moe_shape(args.shape):  # context_bench builds its targets as Llama / Qwen3 models
        p.error(f"--context measures dense shapes only; {args.shape} is a mixture of experts")
    if args.tree and args.dynamic_tree:
        p.error("--tree and --dynamic-tree exclude each other")
    if sum(map(bool, (args.draft_shape, args.sa, args.mtp, args.sa_spec or args.tree or args.dynamic_tree))) > 1:
        p.error("--draft-shape, --sa, --mtp and the EAGLE-3 head's options (--sa-spec, --tree, --dynamic-tree) "
                "exclude each other")
    return args


def spec_of(args: argparse.Namespace) -> tuple[str, dict]:
    """(random_spec_model's spec, its config fields) for the drafter the flags ask for."""
    if args.draft_shape:
        return "draft_target", {}
    if args.sa:
        return "sa", {}
    if args.mtp:
        return "mtp", {}
    return "eagle3", {**tree_fields(args), **({"use_sa_spec": True} if args.sa_spec else {})}


def tree_fields(args: argparse.Namespace) -> dict:
    """Eagle3Config fields of the tree the flags ask for (none: a chain of -k); sets -k to its depth."""
    if args.tree:
        choices = DEFAULT_EAGLE_CHOICES if args.tree == "default" else json.loads(args.tree)
        args.max_draft_len = max(len(c) for c in choices)
        return {"eagle_choices": [list(c) for c in choices]}
    if args.dynamic_tree:
        top_k, size, args.max_draft_len = args.dynamic_tree
        return {"use_dynamic_tree": True, "dynamic_tree_max_topK": top_k, "max_total_draft_tokens": size}
    return {}


def main() -> None:
    args = parse_args()
    if args.plot_only:
        data = json.loads(Path(args.plot_only).read_text())
        plotter = plot_startup if "fresh_ready_s" in data else plot_context if data.get("kind") == "context" else plot
        plotter(data, Path(args.plot_only).with_suffix(".png"))
        return
    if args.startup:
        result = run_startup(args.shape, max(args.batches), "cuda", Path(args.out) / f"{args.startup_name}.json",
                             args.gpu_tests)
        print(json.dumps({k: v for k, v in result.items() if k not in ("fresh", "warm")}, indent=1))
        return
    if args.context:
        run_context_benchmark(context_run(args), Path(args.out), Path(args.context_json) if args.context_json else None)
        return
    tp = args.tensor_parallel_size
    if tp > 1 and args.compare_eager:
        raise SystemExit("--compare-eager measures the stock HF layers, which tensor parallelism does not shard")
    first = int(os.environ.get("RANK", "0")) == 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = local_process_device(torch.device("cuda")) if tp > 1 else torch.device("cuda")
    spec_name, spec_fields = spec_of(args)
    tree = {name: value for name, value in spec_fields.items() if name != "use_sa_spec"}
    k = args.max_draft_len
    forced = args.forced if args.forced is not None else sorted({*range(k + 1), 1.5})
    bandwidth = measure_bandwidth(device)
    engine = {"max_batch_size": max(args.batches), "max_seq_len": args.prompt_len + args.new_tokens + 8,
              "kv_cache_fraction": 0.2 if args.compare_eager else 0.5, "tensor_parallel_size": tp,
              "tp_all_reduce": args.tp_all_reduce, "tp_draft": args.tp_draft}
    results = {"gpu": torch.cuda.get_device_name(device), "tensor_parallel_size": tp, "shape": args.shape, "k": k,
               "tp_all_reduce": args.tp_all_reduce, "tp_draft": args.tp_draft,
               "dtype": "bfloat16", "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
               "date": time.strftime("%Y-%m-%d"), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "bandwidth_bytes_per_s": bandwidth, "points": [], "hf": [], "profile": [], "tree": tree or None,
               "spec": spec_name, "spec_fields": spec_fields, "draft_shape": args.draft_shape,
               "moe": None}  # routing.moe_summary of the target, once built
    variants = [("default", {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype})]
    default_models = None
    if args.quantization or args.kv_cache_dtype == "fp8":
        variants.append(("bf16", {}))
    if args.compare_eager:  # the default compiles the step where compile_step="auto" finds that it pays
        stock = {"use_fused_layers": False, "compile_step": False}
        if is_moe_shape(args.shape):  # the stock expert loop syncs with the host: no graph can capture it
            stock["enforce_eager"] = True
        variants += [("fused, compiled", {"compile_step": True}), ("fused, not compiled", {"compile_step": False}),
                     ("stock HF layers", stock)]
    for name, options in variants:
        if name not in ("default", "bf16") and options.get("use_fused_layers", True) and \
                options.get("compile_step") == default_models[1].runner.graph_runner.compile_step:
            continue  # the default already measured it
        start = time.perf_counter()
        options = dict(options)
        quantization = options.pop("quantization", None)
        with tempfile.TemporaryDirectory() as workdir:
            spec = random_spec_model(args.shape, spec_name, k, workdir, torch.bfloat16, "cuda",
                                     spec_fields=spec_fields, draft_shape=args.draft_shape or "llama-3.2-1b",
                                     quantization=quantization, **engine, **options)
        plain = SpecModel.from_target(spec.target, None, **engine, **options)
        todo = forced if name == "default" else [float(k)]
        force_acceptance(plain, None)  # each captured as its first points run: forcing on or off recompiles
        force_acceptance(spec, todo[0])
        for model in (plain, spec):
            if model.runner.graph_runner is not None:
                model.runner.graph_runner.capture_all()
        results["moe"] = results["moe"] or moe_summary(spec.target)
        tqdm.write(f"{name}: built and prepared ({engine_path(spec)}) in {time.perf_counter() - start:.1f} s")
        jobs = [(b, None, plain) for b in args.batches] + [(b, f, spec) for b in args.batches for f in todo]
        for batch, f, model in tqdm(jobs, desc=f"benchmark ({name})", disable=not first):
            point = run_point(model, batch, args.prompt_len, args.new_tokens, f, bandwidth["gemv"])
            results["points"] += [{**row, "variant": name} for row in to_rows([point])]
            if not first:
                continue
            (out / "benchmark.json").write_text(json.dumps(results, indent=2))  # partial results survive a crash
            experts = (f"  experts/layer {point.distinct_experts_per_layer:.1f}"
                       if point.distinct_experts_per_layer is not None else "")
            if point.draft_experts_per_step is not None:  # a MoE MTP block: its passes' experts, summed
                experts += f"  draft experts/step {point.draft_experts_per_step:.1f}"
            tqdm.write(f"{name[:10]:10s} {point.mode:6s} batch {batch:3d} forced {f!s:5s} step "
                       f"{point.step_ms:7.2f} ms {point.tokens_per_second:9.1f} tok/s  roofline "
                       f"{point.roofline_fraction:5.1%}  host {point.host_ms_per_step:.3f} ms{experts}")
        if name != "default":
            del spec, plain
            torch.cuda.empty_cache()
            continue
        default_models = (plain, spec)
    plain, spec = default_models
    if args.profile:
        for model, forced in ((plain, None), (spec, float(k))):
            results["profile"].append(profile_step(model, args.profile_batch, args.prompt_len, forced))
            if first:
                print(format_profile(results["profile"][-1]))
    if first:
        hf_baseline(spec, args, results, out)
        print(table(results))
        plot(results, out / "benchmark.png")
    if args.draft_len_sweep:  # last (every rank: tensor-parallel steps are collective); each length recompiles
        sweep(spec, args, bandwidth["gemv"], results, out, first)


def hf_baseline(spec: SpecModel, args: argparse.Namespace, results: dict, out: Path) -> None:
    """HF generate per batch size (dynamic cache) and per --hf-static-batches (static cache), for a MoE target once
    per --hf-experts implementation; a run that fails is recorded with its error (the others still run)."""
    hf_runs = [] if args.no_hf or args.tensor_parallel_size > 1 else [(b, False) for b in args.batches] + [
        (b, True) for b in args.hf_static_batches]
    experts = args.hf_experts if results["moe"] else [None]
    for (batch, static), impl in itertools.product(hf_runs, experts):
        try:
            row = hf_generate_row(spec, batch, args.prompt_len, args.new_tokens, static, impl)
            tqdm.write(f"{row['path']}, batch {batch}: {row['tokens_per_second']:.1f} tok/s")
        except Exception as err:  # noqa: BLE001 (e.g. a static cache's compile of the expert loop): kept in the JSON
            row = {"batch": batch, "static_cache": static, "experts_implementation": impl, "error": repr(err)}
            tqdm.write(f"HF generate batch {batch} static={static} experts={impl}: failed: {err!r}")
        results["hf"].append(row)
        (out / "benchmark.json").write_text(json.dumps(results, indent=2))
    (out / "benchmark.json").write_text(json.dumps(results, indent=2))


def sweep(spec: SpecModel, args: argparse.Namespace, bandwidth: float, results: dict, out: Path,
          first: bool) -> None:
    record = results["draft_len_sweep"] = {"acceptance": args.sweep_acceptance, "points": [], "schedule": None}

    def measured(p) -> None:  # each point is written as it comes (a long sweep may be cut short)
        record["points"].append(to_rows([p])[0])
        if not first:
            return
        (out / "benchmark.json").write_text(json.dumps(results, indent=2))
        tqdm.write(f"sweep batch {p.batch:3d} draft_len {p.draft_len} forced {p.forced_drafts or 0:.2f} step "
                   f"{p.step_ms:7.2f} ms {p.tokens_per_second:9.1f} tok/s")

    _, record["schedule"] = sweep_draft_len(spec, args.batches, args.prompt_len, args.new_tokens,
                                            args.sweep_acceptance, bandwidth, on_point=measured)
    if not first:
        return
    (out / "benchmark.json").write_text(json.dumps(results, indent=2))
    print(f"fastest draft length per batch size at acceptance {args.sweep_acceptance}: "
          f"draft_len_schedule={record['schedule']}")


if __name__ == "__main__":
    main()
