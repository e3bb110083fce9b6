"""FlashInfer chain speculative sampling vs the torch reference, and the graphed engine with it."""
import pytest
import torch

from tllm_spec import Eagle3Config
from tllm_spec.sampling import flashinfer_ops
from tllm_spec.sampling.rejection import rejection_sample, rejection_sample_ref
from tllm_spec.spec_model import SpecModel

from ..models import tiny_pair
from ..sampling.test_distribution import exact_joint, pvalue, sample_pairs
from ..sampling.test_rejection import P0, P1, P2, V

pytestmark = pytest.mark.cuda
N = 40000


def _emitted_pairs(fn, p_rows, q_rows, seed):
    p = torch.stack(p_rows).cuda()[None].expand(N, 3, V).contiguous()
    q = torch.stack(q_rows).cuda()[None].expand(N, 2, V).contiguous()
    g = torch.Generator(device="cuda").manual_seed(seed)
    d = torch.stack([torch.multinomial(q[:, i], 1, generator=g)[:, 0] for i in range(2)], 1)
    tokens, n = fn(p, q, d, torch.tensor([seed], device="cuda"), torch.tensor([0], device="cuda"))
    keep = n >= 2  # pairs emitted within one step
    return tokens[keep, 0].cpu(), tokens[keep, 1].cpu(), tokens[:, 0].cpu(), n.cpu()


@pytest.mark.parametrize("path", ["flashinfer", "torch"])
def test_paths_agree_in_distribution(path):
    if path == "flashinfer" and not flashinfer_ops.available(torch.device("cuda")):
        pytest.skip("flashinfer not installed")
    fn = (lambda *a: rejection_sample(*a, use_flashinfer=True)) if path == "flashinfer" else rejection_sample_ref
    q0, q1 = P1, P2
    a, b, first, n = _emitted_pairs(fn, [P0, P1, P2], [q0, q1], seed=5)
    counts = torch.bincount(first, minlength=V).double()
    expected = P0.double() * len(first)
    stat = ((counts - expected) ** 2 / expected).sum().item()
    assert stat < 30  # chi-square, 7 dof: p ~ 1e-4
    # accepted-first-draft rate is sum_x min(p0, q0)
    assert abs((n >= 2).float().mean().item() - torch.minimum(P0, q0).sum().item()) < 0.02


def test_graphed_engine_with_rejection_sampling_keeps_target_distribution():
    target, head = tiny_pair("llama", vocab_size=V, seed=4)
    cfg = Eagle3Config(speculative_model=str(head), max_draft_len=3, use_rejection_sampling=True)
    model = SpecModel.from_pretrained(target, cfg, device="cuda", dtype=torch.float32, max_batch_size=64,
                                      compile_step=False)
    counts, _ = sample_pairs(model, 1.0, seed=3)
    assert model.runner.graph_runner.graphs
    assert pvalue(counts, exact_joint(target, 1.0)) > 1e-3
