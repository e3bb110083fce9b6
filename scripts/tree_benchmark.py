"""Draft trees against a chain on the GPU: step cost and tokens/s of each draft shape at each batch size.

One random target of a named shape (no download) and one random EAGLE-3 head, shared by every variant; each
variant is a SpecModel over them (its own CUDA graphs and KV cache). Every draft is forced accepted
(TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS = the depth): the step time measured is the variant's dearest step
(the longest path compacted). A random head's dynamic tree is shallow (forcing stops at the depth it reaches), so
a head's tokens/s is not measured here but derived: ``--accepted`` NAME=TOKENS gives the mean accepted tokens per
step (bonus included) a real head reached with the variant (scripts/eval_acceptance.py), and tokens/s at that
acceptance = TOKENS x the requests decoding per step / the measured step time. Writes OUT/trees.json and
OUT/trees.png.

    python scripts/tree_benchmark.py --batches 1 8 32 --variants chain:3 static:default \
        --accepted chain:3=3.58 static:default=6.71 --out runs/trees

A variant: ``chain:K`` (K drafts), ``static:default`` or ``static:JSON`` (eagle_choices), ``dynamic:TOPK:N:DEPTH``
(a variant the engine refuses is reported and skipped). The table gives each step's cost against the first variant's at the same
batch size (the baseline, a chain) and, among the variants given ``--accepted``, the fastest per batch size.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig

from tllm_spec.config import Eagle3Config
from tllm_spec.model.target import TargetModel
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.benchmark import (
    force_acceptance,
    format_profile,
    measure_bandwidth,
    profile_step,
    run_point,
    to_rows,
)
from tllm_spec.tools.random_models import DRAFT_VOCAB_SIZE, SHAPES, save_random_head
from tllm_spec.tools.tree_report import plot, summarise, table, variant_fields


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--variants", nargs="+", default=["chain:3", "static:default"])
    p.add_argument("--accepted", nargs="*", default=[], metavar="VARIANT=TOKENS",
                   help="the head's mean accepted tokens per step (bonus included) for a variant")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--no-compile", action="store_true", help="CUDA graphs of the uncompiled step")
    p.add_argument("--profile", action="store_true", help="kernel-time breakdown of each variant's step at batch 1")
    p.add_argument("--out", default="runs/trees")
    args = p.parse_args()
    for name in args.variants:
        try:
            variant_fields(name)
        except ValueError as err:
            p.error(str(err))
    args.accepted = {k: float(v) for k, _, v in (a.rpartition("=") for a in args.accepted)}
    unknown = set(args.accepted) - set(args.variants)
    if unknown:
        p.error(f"--accepted names variants not in --variants: {sorted(unknown)}")
    return args


def measure(args: argparse.Namespace) -> dict:
    config = AutoConfig.for_model("qwen3" if args.shape == "qwen3-8b" else "llama", **SHAPES[args.shape])
    target = TargetModel.from_config(config, torch.bfloat16, "cuda", 0, None)
    bandwidth = measure_bandwidth(torch.device("cuda"))
    engine = dict(max_batch_size=max(args.batches), max_seq_len=args.prompt_len + args.new_tokens + 80,
                  kv_cache_fraction=0.5, compile_step=not args.no_compile)
    result = {"gpu": torch.cuda.get_device_name(), "shape": args.shape, "dtype": "bfloat16",
              "date": time.strftime("%Y-%m-%d"), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "compiled": not args.no_compile, "bandwidth_bytes_per_s": bandwidth, "accepted": args.accepted,
              "variants": {}, "points": [], "profiles": {}}
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as workdir:
        head = save_random_head(Path(workdir) / "eagle3", config, seed=1,
                                draft_vocab_size=min(config.vocab_size, DRAFT_VOCAB_SIZE))
        for name in args.variants:
            fields = variant_fields(name)
            forced = float(fields["max_draft_len"])
            start = time.perf_counter()
            try:
                model = SpecModel.from_target(target, Eagle3Config(speculative_model=str(head), **fields), **engine)
            except ValueError as err:  # e.g. a dynamic tree on CUDA before its GPU check
                tqdm.write(f"{name}: refused, skipped: {err}")
                result.setdefault("refused", {})[name] = str(err)
                continue
            force_acceptance(model, forced)  # before the capture: forcing on or off recompiles
            if model.runner.graph_runner is not None:
                model.runner.graph_runner.capture_all()
            tree = getattr(model.worker, "tree_step", None)
            result["variants"][name] = {"fields": fields,
                                        "verified_tokens": (tree.num_nodes if tree else fields["max_draft_len"]) + 1,
                                        "capture_s": round(time.perf_counter() - start, 1)}
            for batch in tqdm(args.batches, desc=name):
                point = to_rows([run_point(model, batch, args.prompt_len, args.new_tokens, forced,
                                           bandwidth["gemv"])])[0]
                result["points"].append({"variant": name, **point})
                out.mkdir(parents=True, exist_ok=True)
                (out / "trees.json").write_text(json.dumps(result, indent=2))  # partial results survive a crash
                tqdm.write(f"{name:16s} batch {batch:3d} step {point['step_ms']:7.2f} ms "
                           f"({point['tokens_per_step']:.2f} tokens/step forced)")
            if args.profile:
                result["profiles"][name] = profile_step(model, 1, args.prompt_len, forced)
                tqdm.write(format_profile(result["profiles"][name]))
            del model
            torch.cuda.empty_cache()
    return result


def main() -> None:
    args = parse_args()
    result = summarise(measure(args))
    out = Path(args.out)
    (out / "trees.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "trees.png")
    print(table(result))


if __name__ == "__main__":
    main()
