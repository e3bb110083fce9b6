r"""Acceptance of every speculative method (the EAGLE-3 and MTP heads, the draft LM, suffix drafting, each head with
suffix drafting on top) on two workloads (first lines of held-out files; editing a quoted function), at T = 0 and
T = 1, and tokens/s with vs without speculation.

    python scripts/eval_acceptance.py                         # the shipped demo models, every method, CPU
    python scripts/eval_acceptance.py --tree                  # ... and the EAGLE-3 head drafting the default tree
    python scripts/eval_acceptance.py --tree --dynamic-tree 3 25 8   # ... and growing a dynamic tree
    python scripts/eval_acceptance.py --workloads edit --draft-model none --sa-k 4 --sa-spec-threshold 0
    python scripts/eval_acceptance.py --target /models/llama --eagle3 /heads/e3 --mtp none \
        --prompts-from heldout.json --device cuda --out runs/eval
    python scripts/eval_acceptance.py --quantization fp8        # the demo target in FP8, its drafts as they are

With --quantization, also the quantized target's top-1 agreement with the 16-bit one over held-out text.
Writes OUT/acceptance.json (the first-line workload at its top level, every workload under "workloads"),
OUT/acceptance.md (a summary table, then one table per workload) and OUT/acceptance.png (if matplotlib is installed).
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
    add_head_arguments,
    given,
    head_configs,
    heldout_texts,
)
from tllm_spec.tools.eval_workloads import (
    WORKLOADS,
    evaluate_workloads,
    format_report,
    plot,
    workload_prompts,
)
from tllm_spec.tools.quant_agreement import quantized_agreement


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_head_arguments(p)
    p.add_argument("--draft-model", default="demo://draft", help="draft LM directory (draft_target), or 'none'")
    p.add_argument("--sa-k", type=int, default=8, help="K of suffix drafting (sa); 0 skips it")
    p.add_argument("--sa-spec-threshold", type=int, default=4, help="suffix-match length from which each head "
                   "takes the automaton's drafts (eagle3+sa, mtp+sa); 0 skips them")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--prompts-from", help="held-out JSON ({'prompts': [{'text': ...}]}) of the first-line "
                   "workload; default: the demo's")
    p.add_argument("--edit-max-chars", type=int, default=1000, help="longest edit prompt, in characters")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("-k", "--max-draft-len", type=int, default=3, help="K of the heads and the draft LM")
    p.add_argument("--tree", nargs="?", const="default", help="also the EAGLE-3 head drafting a static tree "
                   "(eagle3-tree): 'default' (the batch-1 default tree) or eagle_choices as JSON")
    p.add_argument("--dynamic-tree", type=int, nargs=3, metavar=("TOPK", "DRAFTS", "DEPTH"),
                   help="also the EAGLE-3 head growing a dynamic tree (eagle3-dynamic-tree), e.g. 3 25 8")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--speed-prompts", type=int, default=4,
                   help="prompts timed for tokens/s (batch 1, T=0; 0: acceptance only)")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions, the models taking turns (median "
                   "kept; speedups: the median of each repetition's ratio to plain)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantization", choices=["fp8"], help="the target's linear layers quantized to FP8 at load, "
                   "for plain decoding and every method (the drafts keep their precision)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", default="runs/eval")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tree = None if args.tree is None else DEFAULT_EAGLE_CHOICES if args.tree == "default" else json.loads(args.tree)
    heads = head_configs(given(args.eagle3), given(args.mtp), args.max_draft_len, tree, args.dynamic_tree,
                         given(args.draft_model), args.sa_k, args.sa_spec_threshold)
    texts = heldout_texts(args.prompts_from) if "first-line" in args.workloads else []
    prompts = workload_prompts(args.workloads, load_tokenizer(resolve(args.target)), texts, args.num_prompts,
                               args.prompt_tokens, args.edit_max_chars)
    result = evaluate_workloads(args.target, heads, prompts, args.max_new_tokens,
                                temperatures=tuple(args.temperatures), device=args.device, dtype=args.dtype,
                                speed_prompts=args.speed_prompts, repeats=args.repeats,
                                quantization=args.quantization)
    if args.quantization:  # the quantized target's top-1 agreement with the 16-bit one, teacher-forced
        result["top1_agreement"] = quantized_agreement(args.target, args.quantization, args.device, args.dtype)
        print(f"top-1 agreement with the unquantized target: {result['top1_agreement']['agreement']:.2%} over "
              f"{result['top1_agreement']['positions']} held-out positions")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance.json").write_text(json.dumps(result, indent=2))
    report = format_report(result)
    (out / "acceptance.md").write_text(report + "\n")
    print(report)
    if plot(result, out / "acceptance.png"):
        print(f"plot: {out / 'acceptance.png'}")
    print(f"json: {out / 'acceptance.json'}")


if __name__ == "__main__":
    main()
