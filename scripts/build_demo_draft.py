"""Train the embedded demo's draft LM (demo://draft) against an already trained target: the recipe's draft-LM
phase on its own (tllm_spec/tools/demo_draft_lm.py).

    python3 scripts/build_demo_draft.py --steps 4000 --threads 2 --recipe tllm_spec/assets/demo/recipe.json

Trains on every .py file of a standard library (--corpus; default this Python's) except the held-out files
that --heldout lists (and every 10th file of this corpus, should it differ from the one the target was trained
on), scores the draft on the held-out files, times it against the target on this CPU, and writes a complete HF
model directory (bf16 weights, the target's tokenizer) to --out. --recipe adds the numbers to that recipe.json
under "draft_lm".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import sys
from pathlib import Path

import torch

from tllm_spec.demo import ASSETS
from tllm_spec.tools.demo_draft_lm import DraftLMShape, build_draft_lm, record
from tllm_spec.tools.demo_recipe import stdlib_corpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(ASSETS / "target"), help="the trained target (with its tokenizer)")
    p.add_argument("--heldout", default=str(ASSETS / "heldout.json"), help="the held-out list of the target's recipe")
    p.add_argument("--out", default=str(ASSETS / "draft"), help="where the draft LM is written")
    p.add_argument("--corpus", help="a standard library directory (default: this Python's)")
    p.add_argument("--minutes", type=float, help="wall-clock budget of data preparation and training (default 20 "
                   "without --steps; the loop plans its steps from the first few, once)")
    p.add_argument("--steps", type=int, help="optimizer steps, however long they take (a plan that a slow start on "
                   "a shared machine cannot shorten)")
    p.add_argument("--objective", choices=("text", "rollouts", "kl"), default=DraftLMShape.objective,
                   help="cross-entropy on corpus text, on the target's rollouts mixed with text, or KL to the target")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--recipe", help="a recipe.json to record the phase in (under 'draft_lm')")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = dataclasses.replace(DraftLMShape(), objective=args.objective,
                                **({"max_steps": args.steps} if args.steps else {}))
    minutes = args.minutes if args.minutes is not None or args.steps else 20.0
    summary = build_draft_lm(stdlib_corpus(args.corpus), Path(args.target), Path(args.heldout), Path(args.out),
                             minutes, shape, torch.device(args.device), progress=not args.no_progress)
    summary = {"command": shlex.join(["python3"] + sys.argv), "python": platform.python_version(),
               "torch": torch.__version__, "device": args.device, "threads": torch.get_num_threads(), **summary}
    if args.recipe:
        record(Path(args.recipe), summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "shape"}, indent=1))


if __name__ == "__main__":
    main()
