"""Prefix caching on against off on one random-weight model served by tllm-spec serve (see
tllm_spec/tools/prefix_cache_bench.py): a shared-prefix and a multi-turn load, each with the cache on then off;
TTFT p50 and output throughput on / off and the hit rate against the ideal, with the targets.

    python3 scripts/prefix_cache_bench.py --out runs/prefix_cache        # the targets' loads, 8B shape, one GPU
    python3 scripts/prefix_cache_bench.py --shape tiny --device cpu --shared-prefix-len 64 --question-len 8 \\
        --output-len 8 --concurrency 4 --num-prompts 8 --turns 3 --num-conversations 4 --out runs/prefix_tiny
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tllm_spec.tools.prefix_cache_bench import format_table, run, workloads
from tllm_spec.tools.random_models import SHAPES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--forced", type=float, default=2.5, help="drafts accepted per step (forced)")
    p.add_argument("--max-draft-len", type=int, default=3, help="the EAGLE-3 head's drafts per step")
    p.add_argument("--device", default="cuda")
    p.add_argument("--workloads", nargs="+", choices=["shared-prefix", "multi-turn"],
                   default=["shared-prefix", "multi-turn"])
    p.add_argument("--concurrency", type=int, default=16, help="requests (multi-turn: conversations) in flight")
    p.add_argument("--num-prompts", type=int, default=256, help="shared-prefix: requests")
    p.add_argument("--shared-prefix-len", type=int, default=4096, help="shared-prefix: tokens of the shared prefix")
    p.add_argument("--question-len", type=int, default=128, help="tokens of each question")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    p.add_argument("--turns", type=int, default=8, help="multi-turn: requests per conversation")
    p.add_argument("--num-conversations", type=int, default=32, help="multi-turn: conversations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", action="store_true", help="no warm-up load before each workload")
    p.add_argument("--out", default="runs/prefix_cache_bench")
    args = p.parse_args()
    loads = workloads(tuple(args.workloads), args.concurrency, args.num_prompts, args.shared_prefix_len,
                      args.question_len, args.output_len, args.turns, args.num_conversations)
    result = run(loads, Path(args.out), args.shape, args.forced, args.device, args.max_draft_len, args.seed,
                 not args.no_warmup)
    print(format_table(result))
    print(f"wrote {Path(args.out) / 'prefix_cache_bench.json'}")


if __name__ == "__main__":
    main()
