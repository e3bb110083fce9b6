"""Speed of a mixture-of-experts layer's experts (kernels/fused_moe.py: the alignment, gate|up with SwiGLU, down with
the routing weight) over a grid of tiles, for the rows of decoding and verify steps, at a model's expert shape.

Every timed call routes its tokens to other random experts (k distinct a token, as a router chooses them) and the
calls replay from one CUDA graph, so the numbers are HBM reads of the experts hit without launch gaps. A call's
bytes are its distinct experts' weights (the step roofline's count). Sweeps gate|up's tile with down's at
tile_config's choice, then down's with gate|up's best; each both aligned and direct (one pair a block, no alignment)
where the pairs are few. Prints us and GB/s per variant and the best; writes the JSON.

    python3 scripts/bench_fused_moe.py --shape qwen3-30b-a3b --rows 1 4 64 256 --out moe_tiles.json
    python3 scripts/bench_fused_moe.py --shape mixtral-8x7b --rows 1 4 --tiles chosen   # tile_config's only
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from bench_skinny_linear import time_per_call
from tllm_spec.kernels.fused_moe import MoeTiles, fused_moe, fused_moe_ref, tile_config
from tllm_spec.kernels.moe_align import moe_align

SHAPES = {  # name -> (hidden, intermediate of one expert (this rank's share), experts, experts a token)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "glm-4.5-air-tp2": (4096, 704, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
SMEM = 200 * 1024
GATE_UP = [c for c in itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 4, 5))
           if c[3] * (16 * c[1] + 2 * c[1] * c[0]) * 2 <= SMEM]  # BLOCK_N, BLOCK_K, warps, stages
DOWN = [c for c in itertools.product((16, 32, 64, 128), (64, 128, 256), (4,), (3, 4, 5))
        if c[3] * (16 * c[1] + c[1] * c[0]) * 2 <= SMEM]
DIRECT_UP_TO = 64  # pairs: the direct blocks are timed up to here


def routings(tokens: int, experts: int, top_k: int, count: int) -> list[torch.Tensor]:
    """``count`` random routings [tokens, k] int32 (k distinct experts a token)."""
    return [torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices.int() for _ in range(count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tiles", choices=("grid", "chosen"), default="grid")
    parser.add_argument("--calls", type=int, default=24, help="calls (routings) in the timed graph")
    parser.add_argument("--out", default=None, help="JSON results file")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    hidden, inter, experts, top_k = SHAPES[args.shape]
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5
    down = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * inter ** -0.5
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * 2
    results = {"device": torch.cuda.get_device_name(0), "shape": args.shape, "hidden": hidden, "inter": inter,
               "experts": experts, "top_k": top_k, "points": []}
    for rows in args.rows:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        ids = routings(rows, experts, top_k, args.calls)
        weights = torch.softmax(torch.randn(rows, top_k, device="cuda"), -1)
        nbytes = sum(len(i.unique()) for i in ids) / len(ids) * expert_bytes
        pairs = rows * top_k
        chosen = tile_config(rows, top_k, experts, hidden, inter, torch.bfloat16)
        ref = fused_moe_ref(x, gate_up, down, weights, ids[0], reduce=False)
        point = {"rows": rows, "pairs": pairs, "bytes": nbytes, "chosen": list(chosen), "variants": {}}

        def run(tiles: MoeTiles) -> float | None:
            key = json.dumps(list(tiles))
            if key not in point["variants"]:
                try:
                    out = fused_moe(x, gate_up, down, weights, ids[0], reduce=False, tiles=tiles)
                except Exception as exc:  # a tile that does not compile or fit on this GPU: skip it
                    print(f"  rows {rows} {tiles}: {type(exc).__name__}: {str(exc)[:80]}", file=sys.stderr)
                    point["variants"][key] = None
                    return None
                torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
                point["variants"][key] = time_per_call(
                    lambda i: fused_moe(x, gate_up, down, weights, i, reduce=False, tiles=tiles), ids) * 1e6
            return point["variants"][key]

        def best(candidates: list[MoeTiles]) -> MoeTiles:
            timed = [(run(t), t) for t in candidates]
            return min((us, t) for us, t in timed if us is not None)[1]

        directs = (False, True) if pairs <= DIRECT_UP_TO else (False,)
        run(chosen)
        if args.tiles == "grid":
            gu = best([chosen._replace(gate_up=c, direct=d) for c in GATE_UP for d in directs])
            best([gu._replace(down=c, direct=d) for c in DOWN for d in directs])
        point["align_us"] = time_per_call(lambda i: moe_align(i, experts, chosen.block_m), ids) * 1e6
        timed = {k: v for k, v in point["variants"].items() if v is not None}
        point["best"] = min(timed, key=timed.get)
        for name, key in (("chosen", json.dumps(list(chosen))), ("best", point["best"])):
            us = timed[key]
            print(f"{args.shape} rows={rows:3d} pairs={pairs:4d} {name:6s} {us:7.1f} us "
                  f"{nbytes / us / 1e3:6.0f} GB/s {key}", flush=True)
        print(f"{args.shape} rows={rows:3d} alignment alone {point['align_us']:.1f} us", flush=True)
        results["points"].append(point)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
