"""An fp32 router's logits for a decoding step's rows: cuBLAS (``F.linear(x.float(), weight)``, the stock router)
against tllm_spec's kernel (kernels/router_logits.py), us per call, each call reading another copy of the weight
(copies together > 4x the L2 cache) from one CUDA graph.

    python3 scripts/bench_router_logits.py --rows 1 4
    TLLM_SPEC_DEPENDENT_LAUNCH=0 python3 scripts/bench_router_logits.py   # each launch waits for the one before
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_skinny_linear import time_per_call
from tllm_spec.kernels.router_logits import router_logits

SHAPES = {"glm-4.5-air": (128, 4096), "glm-4.5": (160, 5120)}  # (experts, hidden)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--out", default=None, help="JSON results file")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results = {"device": torch.cuda.get_device_name(0), "points": []}
    for name, (experts, hidden) in SHAPES.items():
        copies = max(2, -(-4 * l2 // (experts * hidden * 4)))
        weights = [torch.randn(experts, hidden, device="cuda") * 0.02 for _ in range(copies)]
        for rows in args.rows:
            x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
            err = (router_logits(x, weights[0]) - F.linear(x.float(), weights[0])).abs().max().item()
            point = {"shape": name, "rows": rows, "max_abs_diff": err,
                     "cublas_us": time_per_call(lambda w: F.linear(x.float(), w), weights) * 1e6,
                     "kernel_us": time_per_call(lambda w: router_logits(x, w), weights) * 1e6}
            print(f"{name:12s} rows={rows}: cuBLAS {point['cublas_us']:5.1f} us, kernel {point['kernel_us']:5.1f} us "
                  f"(max |diff| {err:.1e})", flush=True)
            results["points"].append(point)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
