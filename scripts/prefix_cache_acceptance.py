"""Acceptance with the prefix cache cold and warm, per drafter, on the demo pair or your own (tllm_spec/tools/
prefix_acceptance.py): identical outputs, warm mean accepted length at least the cold one's.

    python scripts/prefix_cache_acceptance.py                      # the embedded demo pair, CPU
    python scripts/prefix_cache_acceptance.py --target DIR --eagle3 HEAD --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tllm_spec.demo import resolve
from tllm_spec.drafts.tree import DEFAULT_EAGLE_CHOICES
from tllm_spec.tokenizer import load_tokenizer
from tllm_spec.tools.acceptance_eval import add_head_arguments, given, head_configs, heldout_texts, prompt_ids
from tllm_spec.tools.prefix_acceptance import evaluate, format_table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_head_arguments(p)
    p.add_argument("--no-tree", action="store_true", help="skip the EAGLE-3 head drafting the default static tree")
    p.add_argument("-k", "--max-draft-len", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=256, help="the shared prefix of the 'shared' set")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", default="runs/prefix_acceptance")
    args = p.parse_args()
    heads = head_configs(given(args.eagle3), given(args.mtp), args.max_draft_len,
                         None if args.no_tree else DEFAULT_EAGLE_CHOICES)
    prompts = prompt_ids(load_tokenizer(resolve(args.target)), heldout_texts(), args.num_prompts, args.prompt_tokens)
    result = evaluate(args.target, heads, prompts, args.max_new_tokens, args.prefix_tokens,
                      tuple(args.temperatures), args.device, args.dtype, args.page_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix_acceptance.json").write_text(json.dumps(result, indent=2))
    print(format_table(result))
    print(f"json: {out / 'prefix_acceptance.json'}")


if __name__ == "__main__":
    main()
