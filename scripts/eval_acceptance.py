r"""Acceptance of the draft heads on held-out prompts (T = 0 and T = 1) and tokens/s with vs without speculation.

    python scripts/eval_acceptance.py                         # the shipped demo pair, both heads, CPU
    python scripts/eval_acceptance.py --tree                  # ... and the EAGLE-3 head drafting the default tree
    python scripts/eval_acceptance.py --tree --dynamic-tree 3 25 8   # ... and growing a dynamic tree
    python scripts/eval_acceptance.py --target /models/llama --eagle3 /heads/e3 --mtp none \
        --prompts-from heldout.json --device cuda --out runs/eval

Writes OUT/acceptance.json, OUT/acceptance.md (a table) and OUT/acceptance.png (if matplotlib is installed).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tllm_spec.demo import resolve
from tllm_spec.drafts.tree import DEFAULT_EAGLE_CHOICES
from tllm_spec.tokenizer import load_tokenizer
from tllm_spec.tools.acceptance_eval import (
    evaluate,
    format_table,
    head_configs,
    heldout_texts,
    plot,
    prompt_ids,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="demo://target")
    p.add_argument("--eagle3", default="demo://eagle3", help="EAGLE-3 head directory, or 'none'")
    p.add_argument("--mtp", default="demo://mtp", help="MTP weights directory, 'target' (inside the target "
                   "checkpoint) or 'none'")
    p.add_argument("--prompts-from", help="held-out JSON ({'prompts': [{'text': ...}]}); default: the demo's")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("-k", "--max-draft-len", type=int, default=3)
    p.add_argument("--tree", nargs="?", const="default", help="also the EAGLE-3 head drafting a static tree "
                   "(eagle3-tree): 'default' (the batch-1 default tree) or eagle_choices as JSON")
    p.add_argument("--dynamic-tree", type=int, nargs=3, metavar=("TOPK", "DRAFTS", "DEPTH"),
                   help="also the EAGLE-3 head growing a dynamic tree (eagle3-dynamic-tree), e.g. 3 25 8")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--speed-prompts", type=int, default=4,
                   help="prompts timed for tokens/s (batch 1, T=0; 0: acceptance only)")
    p.add_argument("--repeats", type=int, default=2, help="timed repetitions (best kept)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", default="runs/eval")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tree = None if args.tree is None else DEFAULT_EAGLE_CHOICES if args.tree == "default" else json.loads(args.tree)
    heads = head_configs(None if args.eagle3 == "none" else args.eagle3, None if args.mtp == "none" else args.mtp,
                         args.max_draft_len, tree, args.dynamic_tree)
    texts = heldout_texts(args.prompts_from)
    prompts = prompt_ids(load_tokenizer(resolve(args.target)), texts, args.num_prompts, args.prompt_tokens)
    result = evaluate(args.target, heads, prompts, args.max_new_tokens, tuple(args.temperatures), args.device,
                      args.dtype, args.speed_prompts, args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance.json").write_text(json.dumps(result, indent=2))
    table = format_table(result)
    (out / "acceptance.md").write_text(table + "\n")
    print(table)
    if plot(result, out / "acceptance.png"):
        print(f"plot: {out / 'acceptance.png'}")
    print(f"json: {out / 'acceptance.json'}")


if __name__ == "__main__":
    main()
