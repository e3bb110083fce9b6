"""The counter-based draw's kernel on the GPU: the CPU reference's numbers bit for bit (what makes a seeded request's
tokens the same on every device), eagerly, compiled and inside a CUDA graph, in one launch."""
import pytest
import torch

from tllm_spec.kernels.uniform import uniform_ref
from tllm_spec.sampling import rng

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("streams", [(1, 1), (4, 1), (1, 4), (4, 4)])
@pytest.mark.parametrize("shape", [(4, 128256), (4, 3), (4,)])
def test_uniform_on_the_gpu_is_the_cpu_reference(streams, shape):
    g = torch.Generator().manual_seed(sum(shape))
    seed = torch.randint(0, 2**62, (streams[0],), generator=g)
    offset = torch.randint(0, 2**40, (streams[1],), generator=g)
    cpu = uniform_ref(seed, offset, shape, 7)
    assert torch.equal(rng.uniform(seed.cuda(), offset.cuda(), shape, 7).cpu(), cpu)
    compiled = torch.compile(rng.uniform, dynamic=True, fullgraph=True)
    assert torch.equal(compiled(seed.cuda(), offset.cuda(), shape, 7).cpu(), cpu)


def test_uniform_is_one_launch_in_a_cuda_graph():
    seed, offset = torch.tensor([5], device="cuda"), torch.tensor([9], device="cuda")
    rng.uniform(seed, offset, (4, 1000), 3)  # the kernel compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rng.uniform(seed, offset, (4, 1000), 3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        offset.fill_(10)  # a new offset, read on the device at replay
        graph.replay()
        torch.cuda.synchronize()
    launches = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                and "FillFunctor" not in e.name]  # the replay's kernels, the offset's fill left out
    assert len(launches) == 1 and "_uniform_kernel" in launches[0], launches
    assert torch.equal(out.cpu(), uniform_ref(torch.tensor([5]), torch.tensor([10]), (4, 1000), 3))
