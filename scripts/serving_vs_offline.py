"""The OpenAI server against offline generate() on one random-weight model with forced acceptance (the serving
targets: at concurrency 1 the server's TPOT against the offline step time per token, at concurrency 64 its
output throughput against generate() of the same prompts).

    python3 scripts/serving_vs_offline.py --shape llama-3.1-8b --forced 2.5 --concurrency 1 64 --out runs/svo
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tllm_spec.tools.random_models import SHAPES
from tllm_spec.tools.serving_vs_offline import run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--forced", type=float, default=2.5, help="drafts accepted per step (forced)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--num-prompts", type=int, default=128, help="requests per concurrency above 1 (1: an eighth)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--delay-factors", type=float, nargs="+", help="scheduler_delay_factor values to serve with, "
                   "each in turn (default: the engine's)")
    p.add_argument("--uvicorn-loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                   help="the server's event loop (auto: uvloop where installed)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per point (offline of the same prompts and the "
                   "server): the median is reported")
    p.add_argument("--out", default="runs/serving_vs_offline")
    args = p.parse_args()
    run(args.shape, args.forced, args.concurrency, args.num_prompts, args.input_len, args.output_len, Path(args.out),
        args.device, args.delay_factors, args.uvicorn_loop, args.repeats)


if __name__ == "__main__":
    main()
