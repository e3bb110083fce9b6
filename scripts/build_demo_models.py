"""Build the embedded demo pair from scratch: tokenizer, Llama target, EAGLE-3 head, MTP module, draft LM.

    python3 scripts/build_demo_models.py --out /tmp/demo_out --device cuda --minutes 7 --corpus /usr/lib/python3.11

Trains on a Python standard library's sources (--corpus; default this Python's; the shipped pair used
CPython 3.11's Lib with its test suite), every 10th file held out, every 10th from the 5th the target's
validation set. Writes the pair to WORKDIR/demo and packs it into OUT as demo_assets.tgz.NNN parts (each
< 15 MB) plus build_report.json, then prints the command that unpacks it into tllm_spec/assets/demo.
--minutes is the training budget: the target takes at most 45 % (it stops earlier at its best validation
loss), then the target's rollouts are generated, then the EAGLE-3 head takes 60 % of what is left and the
MTP module the rest; the draft LM (demo://draft) trains for a quarter of --minutes on top (on its own against a
shipped target: scripts/build_demo_draft.py). Tokenizer training, model loading, the CPU acceptance check and
packing come on top
(about 1.5 minutes on a 16-core host). --target-from reuses a target an earlier build trained on the same
corpus (its target/ directory) and gives the drafts the whole budget.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from tllm_spec.tools.demo_assets import unpack_command
from tllm_spec.tools.demo_recipe import TINY_SHAPE, RecipeShape, build_demo_models, stdlib_corpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the packed parts and build_report.json")
    p.add_argument("--workdir", help="where the pair is built (default: a temporary directory)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=7.0, help="training budget of all phases together")
    p.add_argument("--corpus", help="a standard library directory (default: this Python's)")
    p.add_argument("--target-from", help="a target directory (with tokenizer) built earlier on the same corpus")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and a few steps (a smoke test of the recipe)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (logs)")
    args = p.parse_args()
    start = time.perf_counter()
    workdir = args.workdir or tempfile.mkdtemp(prefix="tllm_spec_demo_")
    report = build_demo_models(args.out, workdir, torch.device(args.device), args.minutes,
                               TINY_SHAPE if args.tiny else RecipeShape(), files=stdlib_corpus(args.corpus),
                               target_from=args.target_from, progress=not args.no_progress)
    print(json.dumps({k: report[k] for k in ("phases_s", "target", "eagle3", "mtp", "draft_lm", "cpu_check", "sizes")}, indent=1))
    print(f"total {time.perf_counter() - start:.0f} s; pair built in {workdir}/demo")
    print(f"unpack into the package (from the repository root):\n  {unpack_command(args.out)}")


if __name__ == "__main__":
    main()
