"""Weight-read speed of a decoding step's projections: cuBLAS (``F.linear``) against tllm_spec's skinny-GEMM
kernel over a grid of tile configurations, for the few token rows a decoding step has.

Every timed call reads a different copy of the weight (copies together > 4x the L2 cache), and the calls
replay from one CUDA graph, so the numbers are HBM reads without launch gaps. Prints GB/s per shape, rows and
variant, the best configuration per shape, and writes the JSON.

    python3 scripts/bench_skinny_linear.py --shape llama-3.1-8b --rows 1 4 --out skinny.json
    python3 scripts/bench_skinny_linear.py --rows 4 16 26 32 --tiles chosen   # tile_config's tile only (fast)
    python3 scripts/bench_skinny_linear.py --shape llama-3.1-8b-tp2 --rows 1 4   # one rank's shares at TP 2
    python3 scripts/bench_skinny_linear.py --plot-only skinny.json     # bar chart beside the JSON
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tllm_spec.kernels.skinny_linear import skinny_linear, tile_config

SHAPES = {  # name -> [(projection, N, K)]
    "llama-3.1-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
                     ("lm_head", 128256, 4096), ("eagle3_fc", 4096, 12288), ("draft_lm_head", 32000, 4096)],
    # one rank's shares at tensor parallelism 2 (the EAGLE-3 head split like the target, its fc whole)
    "llama-3.1-8b-tp2": [("qkv", 3072, 4096), ("o", 4096, 2048), ("gate_up", 14336, 4096), ("down", 4096, 7168),
                         ("lm_head", 64128, 4096), ("eagle3_qkv", 3072, 8192), ("eagle3_fc", 4096, 12288),
                         ("draft_lm_head", 16000, 4096)],
    "qwen3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288),
                 ("lm_head", 151936, 4096)],
    # mixture-of-experts targets: the attention's projections, the router (bf16 routers), a shared expert
    "qwen3-30b-a3b": [("qkv", 5120, 2048), ("o", 2048, 4096), ("router", 128, 2048), ("lm_head", 151936, 2048)],
    "glm-4.5-air-tp2": [("qkv", 7168, 4096), ("o", 4096, 6144), ("shared_gate_up", 1408, 4096),
                        ("shared_down", 4096, 704), ("lm_head", 75776, 4096)],
    "mixtral-8x7b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("lm_head", 32000, 4096)],
}
GRID = [c for c in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4, 6))
        if c[0] * c[1] * 2 * c[3] <= 160 * 1024]  # BLOCK_N, BLOCK_K, warps, stages; weight tiles fit in smem


def time_per_call(fn, weights: list[torch.Tensor], reps: int = 5) -> float:
    """Seconds per call: one CUDA graph calls ``fn(w)`` once per weight copy; median of ``reps`` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(weights))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tiles", choices=("grid", "chosen"), default="grid",
                        help="time every tile of the grid, or only the one tile_config chooses")
    parser.add_argument("--out", default=None, help="JSON results file (and a bar chart beside it)")
    parser.add_argument("--plot-only", default=None, help="re-plot an earlier JSON results file")
    args = parser.parse_args(argv)
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot_only).with_suffix(".png"))
        return 0
    torch.manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results = {"device": torch.cuda.get_device_name(0), "shape": args.shape, "points": []}
    for name, n, k in SHAPES[args.shape]:
        copies = max(2, -(-4 * l2 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        nbytes = n * k * 2
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, weights[0]).float()
            point = {"proj": name, "n": n, "k": k, "rows": rows,
                     "cublas_gbps": nbytes / time_per_call(lambda w: F.linear(x, w), weights) / 1e9, "configs": {}}
            for config in GRID if args.tiles == "grid" else [tile_config(n, k, rows)]:
                try:
                    out = skinny_linear(x, weights[0], config=config).float()
                except Exception as exc:  # a tile that does not compile or fit on this GPU: skip it
                    print(f"  {name} rows {rows} {config}: {type(exc).__name__}: {str(exc)[:80]}", file=sys.stderr)
                    continue
                err = (out - ref).abs().max().item()
                assert err <= 0.05 * ref.abs().max().item(), f"{name} rows {rows} {config}: max error {err}"
                seconds = time_per_call(lambda w: skinny_linear(x, w, config=config), weights)
                point["configs"][",".join(map(str, config))] = nbytes / seconds / 1e9
            best = max(point["configs"].items(), key=lambda kv: kv[1])
            point["best"] = best[0]
            chosen = point["configs"].get(",".join(map(str, tile_config(n, k, rows))), float("nan"))
            print(f"{name:14s} N={n:6d} K={k:5d} rows={rows}: cuBLAS {point['cublas_gbps']:6.0f} GB/s, "
                  f"skinny best {best[1]:6.0f} GB/s ({best[0]}), tile_config's {chosen:6.0f}", flush=True)
            results["points"].append(point)
        del weights
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
        plot(results, Path(args.out).with_suffix(".png"))
    return 0


def plot(results: dict, path: Path) -> None:
    """GB/s per projection and row count: cuBLAS, the kernel at :func:`tile_config`'s tile, the best tile."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = results["points"]
    labels = [f"{p['proj']}\n{p['rows']} row{'s' if p['rows'] > 1 else ''}" for p in points]
    series = {"cuBLAS (F.linear)": [p["cublas_gbps"] for p in points],
              "skinny, tile_config": [p["configs"].get(",".join(map(str, tile_config(p["n"], p["k"], p["rows"]))),
                                                       0.0)
                                      for p in points],
              "skinny, best tile": [p["configs"][p["best"]] for p in points]}
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(points)), 4.2))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - 1) * width for x in range(len(points))], values, width, label=name)
    ax.set_xticks(range(len(points)), labels, fontsize=7)
    ax.set_ylabel("weight read, GB/s")
    ax.set_title(f"{results['device']}: {results['shape']} projections, bf16, one CUDA graph, cold L2")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
