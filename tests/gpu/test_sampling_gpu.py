"""FlashInfer sampling vs the torch path, on the GPU."""
import pytest
import torch
from scipy.stats import chi2

from tllm_spec.sampling import flashinfer_ops
from tllm_spec.sampling import sampler as sampling

pytestmark = pytest.mark.cuda
V = 32


def _rows(n, temp, top_k, top_p):
    return (torch.full((n,), temp, device="cuda"), torch.full((n,), top_k, dtype=torch.int32, device="cuda"),
            torch.full((n,), top_p, device="cuda"))


def _chi2_pvalue(samples, probs):
    counts = torch.bincount(samples.cpu(), minlength=V).double()
    probs = probs.cpu().double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a filtered-out token"
    exp = probs[support] * samples.numel()
    return chi2.sf(((counts[support] - exp) ** 2 / exp).sum().item(), int(support.sum()) - 1)


@pytest.fixture(scope="module")
def flashinfer_module():
    if not flashinfer_ops.available(torch.device("cuda")):
        pytest.skip("flashinfer not installed")
    return flashinfer_ops.load_flashinfer()


@pytest.mark.parametrize("temp,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.8), (1.3, 10, 0.9)])
def test_flashinfer_and_torch_paths_follow_the_same_distribution(flashinfer_module, temp, top_k, top_p):
    torch.manual_seed(0)
    row = torch.randn(V, device="cuda") * 1.5
    n = 40000
    logits = row.expand(n, V).contiguous()
    temps, top_ks, top_ps = _rows(n, temp, top_k, top_p)
    expected = sampling.target_probs(row[None], temps[:1], top_ks[:1], top_ps[:1])[0]
    seed, offset = torch.tensor([7], device="cuda"), torch.tensor([0], device="cuda")
    fi = sampling.sample_flashinfer(logits, temps, top_ks, top_ps, seed, offset)
    ref = sampling.sample_ref(logits, temps, top_ks, top_ps, seed, offset)
    assert _chi2_pvalue(fi, expected) > 1e-3
    assert _chi2_pvalue(ref, expected) > 1e-3


def test_greedy_rows_exact_on_both_paths(flashinfer_module):
    torch.manual_seed(1)
    logits = torch.randn(257, 128256, device="cuda", dtype=torch.bfloat16)
    greedy = torch.arange(257, device="cuda") % 3 == 0
    temps = torch.where(greedy, 1.0, 0.8)
    top_ks = torch.where(greedy, 1, 2**31 - 1).to(torch.int32)
    top_ps = torch.where(greedy, 1.0, 0.95)
    seed, offset = torch.tensor([3], device="cuda"), torch.tensor([0], device="cuda")
    for fn in (sampling.sample_flashinfer, sampling.sample_ref):
        out = fn(logits, temps, top_ks, top_ps, seed, offset)
        assert torch.equal(out[greedy], logits.argmax(-1)[greedy])


def test_torch_path_same_tokens_on_cpu_and_gpu():
    torch.manual_seed(2)
    logits = torch.randn(64, 1000)
    temps, top_ks, top_ps = torch.full((64,), 0.9), torch.full((64,), 50, dtype=torch.int32), torch.full((64,), 0.9)
    cpu = sampling.sample_ref(logits, temps, top_ks, top_ps, torch.tensor([9]), torch.tensor([0]))
    gpu = sampling.sample_ref(logits.cuda(), temps.cuda(), top_ks.cuda(), top_ps.cuda(),
                              torch.tensor([9], device="cuda"), torch.tensor([0], device="cuda"))
    assert (cpu == gpu.cpu()).float().mean() > 0.98


@pytest.mark.parametrize("path", ["flashinfer", "torch"])
def test_sampling_inside_cuda_graph_gives_fresh_samples(flashinfer_module, path):
    fn = sampling.sample_flashinfer if path == "flashinfer" else sampling.sample_ref
    logits = torch.zeros(512, V, device="cuda")
    temps, top_ks, top_ps = _rows(512, 1.0, 0, 1.0)
    seed, offset = torch.tensor([1], device="cuda"), torch.tensor([0], device="cuda")
    fn(logits, temps, top_ks, top_ps, seed, offset)  # warm-up (JIT, allocations)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(logits, temps, top_ks, top_ps, seed, offset)
    draws = []
    for _ in range(3):
        graph.replay()
        draws.append(out.clone())
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    assert _chi2_pvalue(torch.cat(draws), torch.full((V,), 1.0 / V)) > 1e-3
