"""Prefill speed and peak memory of one long prompt per chunk size (``max_num_batched_tokens``): the chunked
prefill's cost against its memory bound, no speculation, on one GPU.

    python scripts/sweep_prefill_chunks.py --contexts 32768 131072 --chunks 8192 16384 32768

Each (context, chunk) is timed as the long-context benchmark times TTFT (:func:`measure_context_point`, two
runs, the better kept) after one unmeasured run at that chunk; peak memory is torch's allocator peak, the larger of
the two runs'.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from tllm_spec.tools.context_bench import build_model, measure_context_point, plan_for, random_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--contexts", type=int, nargs="+", default=[32768])
    p.add_argument("--chunks", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    target = random_target(args.shape)
    plan = plan_for(target, [1], args.contexts, 8, 0, 0.7, max(args.contexts))
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        model = build_model(target, "none", 0, plan, 1, False, workdir)
        for context in args.contexts:
            for chunk in args.chunks:
                model.engine.max_num_batched_tokens = chunk
                measure_context_point(model, 1, context, 2, None, 1.0, context, seed=1)  # kernels, caches
                points = [measure_context_point(model, 1, context, 2, None, 1.0, context, seed=2 + i)
                          for i in range(2)]
                best = min(points, key=lambda point: point.ttft_s)
                row = {"context": context, "chunk": chunk, "ttft_s": round(best.ttft_s, 4),
                       "prefill_tokens_per_second": round(best.prefill_tokens_per_second),
                       "peak_gib": round(max(point.peak_memory_gib for point in points), 2)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
