"""The Lamport all-reduce kernel on one GPU: each simulated rank's buffer is a tensor of that GPU, and the ranks'
kernels run side by side on streams of their own, so the push, the polling, the clearing and the alternating
halves run as they do across GPUs (tests/gpu/test_tensor_parallel_gpu.py runs the kernel over NVLink). Every
rank must hold the bits of the sum in rank order, plus the residual, and the RMSNorm kernel's norm of that."""
from __future__ import annotations

import pytest
import torch

from tllm_spec.distributed import lamport
from tllm_spec.kernels.rms_norm import rms_norm

pytestmark = pytest.mark.cuda
EPS = 1e-5


def _ranks(world: int, dtype: torch.dtype) -> list[lamport.LamportBuffers]:
    buffers = [torch.empty(lamport.buffer_elements(dtype, world), dtype=dtype, device="cuda") for _ in range(world)]
    addresses = [b.data_ptr() for b in buffers]
    return [lamport.LamportBuffers.local(b, addresses, rank) for rank, b in enumerate(buffers)]


def _inputs(world: int, rows: int, width: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(rows, width, device="cuda", generator=g).to(dtype) for _ in range(world)]
    xs[0][0, :3] = -0.0  # the empty mark among the values: sent as +0.0, never waited for
    residual = torch.randn(rows, width, device="cuda", generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, device="cuda", generator=g)).to(dtype)
    return xs, residual, weight


def _expected(xs, residual, weight):
    total = xs[0].float()
    for x in xs[1:]:
        total = total + x.float()
    hidden = residual + total.to(residual.dtype) if residual is not None else total.to(xs[0].dtype)
    return hidden, None if weight is None else rms_norm(hidden, weight, EPS)


def _launch_side_by_side(ranks, xs, residual, weight, streams):
    """Each rank's call on its stream, launched one after another while the first ones poll: nothing between the
    launches may serialise the streams (CUDA runs nothing concurrently across a device allocation or a module load),
    so the kernels are loaded and each stream's allocator holds blocks for the outputs first."""
    for rank, (buffers, stream) in enumerate(zip(ranks, streams)):
        lamport.load(xs[rank], residual, weight, EPS, buffers)
        with torch.cuda.stream(stream):
            spare = [torch.empty_like(xs[rank]) for _ in range(2)]
        del spare
    outs = [None] * len(ranks)
    for rank, (buffers, stream) in enumerate(zip(ranks, streams)):
        with torch.cuda.stream(stream):
            outs[rank] = lamport.all_reduce_add_norm(xs[rank], residual, weight, EPS, buffers)
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_rank_holds_the_sum_plus_residual_and_its_norm_across_changing_shapes(world, dtype):
    ranks = _ranks(world, dtype)
    streams = [torch.cuda.Stream() for _ in range(world)]
    # shapes change from call to call (the halves alternate whatever they are); 200 rows: programs loop over rows
    calls = [(1, 4096, True, True), (4, 4096, True, False), (16, 4096, False, False), (3, 64, True, True),
             (200, 64, True, True), (1, 8192, True, True), (7, 2048, False, True), (1, 4096, True, True)]
    for i, (rows, width, with_residual, with_norm) in enumerate(calls):
        xs, residual, weight = _inputs(world, rows, width, dtype, seed=i)
        residual = residual if with_residual else None
        weight = weight if with_norm else None
        outs = _launch_side_by_side(ranks, xs, residual, weight, streams)
        hidden, normed = _expected(xs, residual, weight)
        for out, out_normed in outs:
            assert torch.equal(out, hidden), (i, (out.float() - hidden.float()).abs().max())
            if with_norm:
                assert torch.equal(out_normed, normed), i
            else:
                assert out_normed is None
    for buffers in ranks:  # every element read was cleared again: the buffers are empty between calls
        assert bool((buffers.buffer.view(torch.int16) == lamport.NEGATIVE_ZERO).all())


def test_replayed_cuda_graphs_alternate_halves_on_the_device():
    """The parity lives in device memory: graphs of three calls each, replayed again and again, stay right."""
    world, dtype = 2, torch.bfloat16
    ranks = _ranks(world, dtype)
    streams = [torch.cuda.Stream() for _ in range(world)]
    xs, residual, weight = _inputs(world, 4, 4096, dtype, seed=7)
    _launch_side_by_side(ranks, xs, residual, weight, streams)  # compiles both ranks' kernels
    graphs, outs = [], []
    for rank in range(world):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=streams[rank]):
            h1, n1 = lamport.all_reduce_add_norm(xs[rank], residual, weight, EPS, ranks[rank])
            h2, _ = lamport.all_reduce_add_norm(n1, h1, None, EPS, ranks[rank])
            h3, n3 = lamport.all_reduce_add_norm(h2, residual, weight, EPS, ranks[rank])
        graphs.append(graph)
        outs.append((h3, n3))
    h1, n1 = _expected(xs, residual, weight)
    h2, _ = _expected([n1] * world, h1, None)
    expected = _expected([h2] * world, residual, weight)
    for replay in range(5):
        for graph, stream in zip(graphs, streams):
            with torch.cuda.stream(stream):
                graph.replay()
        torch.cuda.synchronize()
        for h3, n3 in outs:
            assert torch.equal(h3, expected[0]) and torch.equal(n3, expected[1]), replay
