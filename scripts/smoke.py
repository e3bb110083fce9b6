"""Decode with a random-weight target of a named shape (no download): a quick end-to-end check on any device.

    python scripts/smoke.py --shape llama-3.1-8b --batch 4 --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from tllm_spec import SamplingParams
from tllm_spec.tools.random_models import SHAPES, random_spec_model
from tllm_spec.tools.report import format_stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--spec", choices=["eagle3", "none"], default="eagle3")
    p.add_argument("-k", "--max-draft-len", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        model = random_spec_model(args.shape, args.spec, args.max_draft_len, workdir, getattr(torch, args.dtype),
                                  args.device, max_batch_size=args.batch, max_seq_len=1024)
    vocab = model.target.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len + 7 * i,), generator=gen).tolist() for i in range(args.batch)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    model.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    for temperature in (0.0, 0.8):
        start = time.perf_counter()
        outs = model.generate(prompts, params.model_copy(update={"temperature": temperature}))
        print(f"[{args.shape} {args.spec} K={args.max_draft_len} batch={args.batch} T={temperature} "
              f"{args.dtype} {args.device}] {time.perf_counter() - start:.2f} s")
        for out in outs:
            print(f"  request {out.index}: {out.finish_reason}, {len(out.token_ids)} tokens, first {out.token_ids[:8]}")
        print("  " + format_stats(outs.stats))
    if args.device.startswith("cuda"):
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
