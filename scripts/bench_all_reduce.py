"""A tensor-parallel step's all-reduce, timed alone: 64 chained calls of [T, H] replayed in one CUDA graph (as a
decoding step of an 8B target runs them), each followed by what a layer does next (the residual add and the
RMSNorm), through NCCL, torch's one-shot kernel over symmetric memory, tllm_spec's Lamport kernel for the sum alone, and the
Lamport kernel with the add and the norm in it. Checks first that every variant gives the NCCL variant's bits on every rank.

    torchrun --nproc-per-node 2 scripts/bench_all_reduce.py --rows 1 4 16 --out all_reduce.json
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from tllm_spec.distributed import lamport, symmetric
from tllm_spec.distributed.parallel import all_reduce_add_norm
from tllm_spec.kernels.rms_norm import rms_norm

CALLS = 64
EPS = 1e-5
_c10d = torch.ops._c10d_functional


def nccl(x, residual, weight, group):
    h = residual + _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group))
    return h, rms_norm(h, weight, EPS)


def one_shot(x, residual, weight, group):
    h = residual + symmetric.one_shot_all_reduce(symmetric.one_shot_buffer(x, group), x, group)
    return h, rms_norm(h, weight, EPS)


def fused(x, residual, weight, group):
    assert lamport.buffers_for(x, group) is not None
    return all_reduce_add_norm(x, residual, weight, EPS, group)


def lamport_sum(x, residual, weight, group):
    h = residual + lamport.all_reduce_add_norm(x, None, None, EPS, lamport.buffers_for(x, group))[0]
    return h, rms_norm(h, weight, EPS)


VARIANTS = {"nccl": nccl, "one_shot": one_shot, "lamport_sum": lamport_sum, "lamport": fused}


def chain(variant, x, residual, weight, group):
    """CALLS calls, each one's norm the next one's input and its sum the next residual."""
    for _ in range(CALLS):
        residual, x = variant(x, residual, weight, group)
    return residual, x


def time_per_call(variant, x, residual, weight, group, replays: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(variant, x, residual, weight, group)  # warm up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(variant, x, residual, weight, group)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * CALLS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--out", default="all_reduce.json")
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    group = dist.group.WORLD.group_name
    device = torch.device("cuda", local)
    if not symmetric.enable(group, torch.bfloat16, device):
        raise SystemExit("symmetric memory is unavailable here")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"gpu": torch.cuda.get_device_name(), "world": world, "width": args.width, "calls": CALLS, "rows": []}
    for rows in args.rows:
        g = torch.Generator(device=device).manual_seed(rows * 100 + rank)
        x = torch.randn(rows, args.width, device=device, generator=g).bfloat16()
        residual = torch.randn(rows, args.width, device=device, generator=torch.Generator(device).manual_seed(rows)
                               ).bfloat16()
        weight = torch.ones(args.width, device=device, dtype=torch.bfloat16)
        reference = chain(nccl, x, residual, weight, group)
        row = {"rows": rows}
        for name, variant in VARIANTS.items():
            got = chain(variant, x, residual, weight, group)
            row[f"{name}_equal"] = all(torch.equal(a, b) for a, b in zip(got, reference))
            row[f"{name}_us"] = time_per_call(variant, x, residual, weight, group, args.replays)
        results["rows"].append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
