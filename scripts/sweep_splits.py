"""Verify attention alone (one layer, Llama-3.1-8B heads, 4 query tokens per request) at each split count: the
time per call and its share of the bandwidth, beside the automatic choice.

    python scripts/sweep_splits.py --contexts 2048 8192 32768 --batches 1 8
"""
from __future__ import annotations

import argparse

import torch

from tllm_spec.kernels.paged_attention import _num_sms, choose_num_splits
from tllm_spec.tools.attention_bench import (
    VerifyShape,
    copies_for,
    make_inputs,
    paged_run,
    time_per_call_us,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 48, 64])
    p.add_argument("--bandwidth", type=float, default=4.1e12, help="bytes/s the fractions are taken of")
    args = p.parse_args()
    device = torch.device("cuda")
    for batch in args.batches:
        for context in args.contexts:
            shape = VerifyShape(batch, context)
            inputs = make_inputs(shape, device, copies_for(shape))
            auto = choose_num_splits(batch * shape.num_kv_heads, shape.kv_len, _num_sms(device))
            row = []
            for s in [None, *args.splits]:
                us, _ = time_per_call_us(paged_run(shape, inputs, s), len(inputs.caches), device)
                row.append(f"{'auto=' + str(auto) if s is None else s}:{us:.1f}us/{shape.kv_bytes / us / 1e-6 / args.bandwidth:.0%}")
            print(f"batch {batch} context {context}: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
