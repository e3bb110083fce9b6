"""Verify attention alone (one layer, Llama-3.1-8B heads, 4 query tokens per request) at each split count: the
time per call and its share of the bandwidth, beside the automatic choice; with --tiles, per program tile.

    python scripts/sweep_splits.py --contexts 2048 8192 32768 --batches 1 8
    python scripts/sweep_splits.py --query-len 26 --contexts 256 2048 --batches 1 --splits 1 --tiles auto 128x4 64x8
    python scripts/sweep_splits.py --query-len 32 --contexts 256 2048 --batches 1 8 --splits 1 \
        --program-rows 16 32 128 --tree
    python scripts/sweep_splits.py --contexts 32768 --batches 1 --kv-fp8 --tiles auto 64x4 128x4 128x8
"""
from __future__ import annotations

import argparse
import itertools

import torch

from tllm_spec.kernels.attention_plan import choose_num_splits, choose_program_rows, num_sms
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
    p.add_argument("--query-len", type=int, default=4, help="query tokens per request (26: the default tree)")
    p.add_argument("--tiles", nargs="+", default=["auto"],
                   help="program tiles, KEYSxWARPS (e.g. 64x8), or 'auto' (the kernel's own choice)")
    p.add_argument("--program-rows", type=int, nargs="+", default=[0],
                   help="query rows per program at most (a wider run is cut into row blocks); 0: the kernel's own")
    p.add_argument("--tree", action="store_true", help="through the draft-tree path (a mask that hides nothing)")
    p.add_argument("--kv-fp8", action="store_true", help="an FP8 (E4M3) cache: half the bytes per key")
    p.add_argument("--bandwidth", type=float, default=4.1e12, help="bytes/s the fractions are taken of")
    args = p.parse_args()
    device = torch.device("cuda")
    for batch in args.batches:
        for context in args.contexts:
            shape = VerifyShape(batch, context, args.query_len, dtype_bytes=1 if args.kv_fp8 else 2)
            inputs = make_inputs(shape, device, copies_for(shape))
            for tile, rows in itertools.product(args.tiles, args.program_rows):
                run_rows = shape.query_len * shape.num_q_heads // shape.num_kv_heads
                if args.tree or rows:  # the launcher's own split count: over the run's row blocks
                    rows_used = rows or choose_program_rows(run_rows, batch * shape.num_kv_heads, num_sms(device))
                    blocks = -(-run_rows // min(rows_used, max(16, 1 << (run_rows - 1).bit_length())))
                else:
                    blocks = 1
                auto = choose_num_splits(batch * blocks * shape.num_kv_heads, shape.kv_len, num_sms(device))
                keys_warps = None if tile == "auto" else tuple(int(x) for x in tile.split("x"))
                row = []
                for s in [None, *args.splits]:
                    run = paged_run(shape, inputs, s, keys_warps, rows or None, args.tree)
                    us, _ = time_per_call_us(run, len(inputs.caches), device)
                    share = shape.kv_bytes / us / 1e-6 / args.bandwidth
                    row.append(f"{'auto=' + str(auto) if s is None else s}:{us:.1f}us/{share:.0%}")
                print(f"batch {batch} context {context} query_len {args.query_len} tile {tile} "
                      f"rows {rows or 'auto'}: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
