"""Build the embedded demo pair from scratch: tokenizer, Llama target, EAGLE-3 head, MTP module.

    python3 scripts/build_demo_models.py --out /tmp/demo_out --device cuda --minutes 5.5

Trains on this Python's standard library (every 10th file held out, every 10th from the 5th the target's
validation set), writes the pair to WORKDIR/demo and packs it into OUT as demo_assets.tgz.NNN parts (each
< 15 MB) plus build_report.json, then prints the command that unpacks it into tllm_spec/assets/demo.
--minutes is the training budget of the three phases: the target takes at most half (it stops earlier at its
best validation loss), the EAGLE-3 head 60 % of what is left, the MTP module the rest. Tokenizer training,
model loading, the CPU acceptance check and packing come on top (under a minute on a 16-core host).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from tllm_spec.training.assets import unpack_command
from tllm_spec.training.recipe import TINY_SHAPE, RecipeShape, build_demo_models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the packed parts and build_report.json")
    p.add_argument("--workdir", help="where the pair is built (default: a temporary directory)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=5.5, help="training budget of the three phases together")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and a few steps (a smoke test of the recipe)")
    args = p.parse_args()
    start = time.perf_counter()
    workdir = args.workdir or tempfile.mkdtemp(prefix="tllm_spec_demo_")
    report = build_demo_models(args.out, workdir, torch.device(args.device), args.minutes,
                               TINY_SHAPE if args.tiny else RecipeShape())
    print(json.dumps({k: report[k] for k in ("phases_s", "target", "eagle3", "mtp", "cpu_check", "sizes")}, indent=1))
    print(f"total {time.perf_counter() - start:.0f} s; pair built in {workdir}/demo")
    print(f"unpack into the package (from the repository root):\n  {unpack_command(args.out)}")


if __name__ == "__main__":
    main()
