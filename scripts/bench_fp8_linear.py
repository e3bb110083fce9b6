"""Weight-read speed of FP8 projections for a decoding step's few rows: tllm_spec's FP8 kernel (with its
activation quantization kernel in front) over a grid of tiles, against the bf16 skinny-GEMM kernel on the same shapes.

Timing as ``bench_skinny_linear.py`` (weight copies > 4x L2, one CUDA graph per variant). GB/s counts the bytes
each variant must read (FP8: 1 byte per weight; bf16: 2), so the FP8 kernel at the bf16 kernel's GB/s is 2x faster.

    python3 scripts/bench_fp8_linear.py --rows 1 4 16 32 64 --out fp8_linear.json
    python3 scripts/bench_fp8_linear.py --rows 1 4 --tiles chosen --block   # tile_config only, block scales too
    python3 scripts/bench_fp8_linear.py --rows 48 64 80 --tiles chosen --cublas  # where cuBLASLt takes over
    python3 scripts/bench_fp8_linear.py --rows 1 8 --tiles chosen --prefetch 0 512 1024 2048  # the L2 prefetch
    python3 scripts/bench_fp8_linear.py --rows 1 4 16 --quantized  # rows FP8 already (the RMSNorm's), GEMM alone
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from bench_skinny_linear import SHAPES, time_per_call
from tllm_spec.kernels import fp8_linear as fp8_module
from tllm_spec.kernels.fp8_linear import FP8, _cublas, fp8_linear, quantize_activation, tile_config
from tllm_spec.kernels.skinny_linear import skinny_linear

GRID = [c for c in itertools.product((32, 64, 128), (128, 256, 512), (4,), (3, 4, 6))
        if c[0] * c[1] * c[3] <= 160 * 1024]  # BLOCK_N, BLOCK_K, warps, stages; FP8 weight tiles fit in smem
NARROW = [c for c in itertools.product((16, 32), (512, 1024, 2048), (2, 4), (2, 3, 4))
          if c[0] * c[1] * c[3] <= 160 * 1024]  # few output features: more, narrower programs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--tiles", choices=["grid", "narrow", "chosen"], default="grid")
    p.add_argument("--proj", nargs="+", help="only these projections (qkv, o, gate_up, down, eagle3_fc)")
    p.add_argument("--block", action="store_true", help="also 128x128 block scales (fine-grained checkpoints)")
    p.add_argument("--cublas", action="store_true", help="also the path above MAX_ROWS (activation quantization, "
                   "then torch._scaled_mm / cuBLASLt with row-wise scales) at the same rows")
    p.add_argument("--prefetch", type=int, nargs="+", help="the chosen tile with each of these bytes of every "
                   "weight row asked of L2 before the kernel's wait (fp8_{channel,block}_prefetch_<bytes>_gbps)")
    p.add_argument("--quantized", action="store_true", help="the rows come FP8 with their per-token scales, as the "
                   "RMSNorm kernel writes them for qkv and gate/up: the channel-scaled GEMM alone, no quantization")
    p.add_argument("--row-tile-64", action="store_true", help="experiment: the Triton kernel at every row count "
                   "(no cuBLASLt), in tiles of 64 rows above 32 (Hopper's warpgroup MMA)")
    p.add_argument("--out", default="fp8_linear.json")
    args = p.parse_args()
    if args.row_tile_64:
        fp8_module.MAX_ROWS = 1 << 30
        fp8_module.row_tile = lambda rows, wide: 16 if rows <= 16 else 32 if rows <= 32 else 64
    results = {"gpu": torch.cuda.get_device_name(), "rows": args.rows, "shape": args.shape,
               "quantized": args.quantized, "rows_data": []}
    for (proj, n, k), rows in itertools.product(SHAPES[args.shape], args.rows):
        if proj.endswith("lm_head") or (args.proj and proj not in args.proj):
            continue  # lm_heads stay bf16
        copies = max(2, int(4 * 50e6 / (n * k)) + 1)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        row = {"proj": proj, "n": n, "k": k, "rows": rows,
               "bf16_gbps": n * k * 2 / time_per_call(lambda w: skinny_linear(x, w), bf16) / 1e9}
        weights = [w.to(FP8) for w in bf16]
        del bf16
        scales = torch.rand(n, device="cuda") * 1e-2
        x_q, x_scale = quantize_activation(x)
        for block in (False, True) if args.block else (False,):
            ws = torch.rand(n // 128, k // 128, device="cuda") * 1e-2 if block else scales
            inputs = ({"x": x_q, "x_scale": x_scale, "out_dtype": x.dtype} if args.quantized and not block
                      else {"x": x})
            chosen = tile_config(n, k, fp8_module.row_tile(rows, not block), block)  # bf16 results, 16-aligned
            grid = [chosen] if args.tiles == "chosen" else [
                c for c in (NARROW if args.tiles == "narrow" else GRID) if not block or c[1] == 128]
            speeds = {}
            for config in grid:
                try:
                    t = time_per_call(lambda w: fp8_linear(weight=w, weight_scale=ws, block_scales=block, config=config,
                                                           **inputs), weights)
                except Exception as exc:  # noqa: BLE001 (a tile a shape cannot take: out of shared memory)
                    print(f"{proj} {rows} {config}: {type(exc).__name__}")
                    continue
                speeds[config] = n * k / t / 1e9
            best = max(speeds, key=speeds.get)
            key = "block" if block else "channel"
            row[f"fp8_{key}_chosen"], row[f"fp8_{key}_chosen_gbps"] = list(chosen), speeds.get(chosen)
            row[f"fp8_{key}_best"], row[f"fp8_{key}_best_gbps"] = list(best), speeds[best]
            row[f"fp8_{key}_all_gbps"] = {"x".join(map(str, c)): gbps for c, gbps in speeds.items()}
            for nbytes in args.prefetch or []:
                t = time_per_call(lambda w: fp8_linear(weight=w, weight_scale=ws, block_scales=block, prefetch=nbytes,
                                                       **inputs), weights)
                row[f"fp8_{key}_prefetch_{nbytes}_gbps"] = n * k / t / 1e9
        if args.cublas:
            t = time_per_call(lambda w: _cublas(*((x_q, x_scale) if args.quantized else quantize_activation(x)), w,
                                                scales, None, x.dtype, False, None), weights)
            row["fp8_cublas_gbps"] = n * k / t / 1e9
        results["rows_data"].append(row)
        print(json.dumps(row))
        del weights
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
