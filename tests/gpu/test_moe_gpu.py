"""Mixture-of-experts targets (Qwen3-MoE, GLM-4.5, Mixtral) on the GPU: the fused-experts kernel against its
reference, graphed greedy output equal to the target's own (fp32: HF generate; bf16: the same engine without
speculation), no host synchronisation inside the step, the step compiled whole, sampled output keeping the
target's distribution."""
import pytest
import torch

from tllm_spec import Eagle3Config, SamplingParams, trace_cache
from tllm_spec.kernels.fused_moe import fused_moe, fused_moe_ref, tile_config
from tllm_spec.kernels.moe_align import moe_align, moe_align_ref
from tllm_spec.kernels.moe_topk import moe_topk, moe_topk_ref
from tllm_spec.kernels.router_logits import router_logits, router_logits_ref
from tllm_spec.model.moe import MoE
from tllm_spec.spec_model import SpecModel

from ..models import MOE_FAMILIES, eagle3, hf_greedy, tiny_pair
from ..test_mtp_lossless import MODES, mtp_target
from .test_engine_gpu import MAX_NEW, PROMPTS, assert_no_host_sync_in_generation_steps

pytestmark = pytest.mark.cuda
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def spec(kind: str, head, k: int = 3):
    return {"plain": None, "eagle3": eagle3(head, k),
            "tree": Eagle3Config(speculative_model=str(head), max_draft_len=3, eagle_choices=TREE),
            "dynamic": Eagle3Config(speculative_model=str(head), max_draft_len=3, use_dynamic_tree=True,
                                    dynamic_tree_max_topK=2, max_total_draft_tokens=6)}[kind]


@pytest.mark.parametrize("tokens", [1, 4, 32, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_kernel_matches_its_reference(tokens, dtype):
    """Qwen3-30B-A3B's expert shape (hidden 2048, 128 experts of 768, 8 per token) and a small one."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    for hidden, inter, experts, k in ((2048, 768, 128, 8), (64, 32, 8, 2)):
        x = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
        gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) / hidden ** 0.5).to(dtype)
        down = (torch.randn(experts, hidden, inter, device="cuda", generator=g) / inter ** 0.5).to(dtype)
        logits = torch.randn(tokens, experts, device="cuda", generator=g)
        weights, ids = torch.softmax(logits, -1).topk(k, dim=-1)
        out = fused_moe(x, gate_up, down, weights, ids.to(torch.int32))
        ref = fused_moe_ref(x, gate_up, down, weights, ids.to(torch.int32))
        tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out, ref, **tol)
        pairs = fused_moe(x, gate_up, down, weights, ids.to(torch.int32), reduce=False)
        assert pairs.shape == (tokens, k, hidden) and pairs.dtype == torch.float32
        torch.testing.assert_close(pairs.sum(1).to(dtype), out, atol=0, rtol=0)


@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_direct_blocks_equal_the_aligned_ones_to_the_bit(tokens):
    """A pair's row does not depend on the other rows of its block: one pair a block (no alignment) gives the same
    bits as the sorted blocks, so a step's routing to direct or aligned blocks by its pair count keeps speculative
    and plain steps equal."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    hidden, inter, experts, k = 2048, 768, 128, 8
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) / hidden ** 0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, device="cuda", generator=g) / inter ** 0.5).bfloat16()
    ids = torch.randint(0, 16, (tokens, k), device="cuda", generator=g).int()  # 16 experts: many shared
    weights = torch.rand(tokens, k, device="cuda", generator=g)
    tiles = tile_config(tokens, k, experts, hidden, inter, torch.bfloat16)
    direct, aligned = (fused_moe(x, gate_up, down, weights, ids, reduce=False, tiles=tiles._replace(direct=d))
                       for d in (True, False))
    assert torch.equal(direct, aligned)


@pytest.mark.parametrize("pairs", [8, 300, 2048, 4096])
@pytest.mark.parametrize("block_m", [16, 64])
def test_moe_align_kernel_equals_its_reference(pairs, block_m):
    """The two launches (counts per tile, then each tile's placing) against the reference, to the bit."""
    g = torch.Generator(device="cuda").manual_seed(pairs)
    ids = torch.randint(0, 128, (pairs // 8, 8), device="cuda", generator=g).int()
    ids[0, :4] = 3  # one expert with several pairs of one tile
    for out, ref in zip(moe_align(ids, 128, block_m), moe_align_ref(ids, 128, block_m)):
        assert torch.equal(out, ref)


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("sigmoid", [False, True])
@pytest.mark.parametrize("round_to", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_topk_kernel_matches_its_reference(tokens, sigmoid, round_to, dtype):
    """bf16: a softmax router's logits as its GEMM gives them (distinct multiples of 1/16: random ones tie)."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, 128, device="cuda", generator=g) * 3
    if dtype != torch.float32:
        logits = (logits.argsort(dim=-1) - 64).div(16).to(dtype)  # a permutation of 128 values per row
    bias = torch.randn(128, device="cuda", generator=g) * 0.1 if sigmoid else None
    args = (logits, bias, 8, sigmoid, True, 2.5 if sigmoid else 1.0, round_to)
    (weights, ids), (ref_weights, ref_ids) = moe_topk(*args), moe_topk_ref(*args)
    ids, order = ids.sort(dim=-1)
    ref_ids, ref_order = ref_ids.sort(dim=-1)
    assert torch.equal(ids, ref_ids)
    tol = 8e-3 if round_to else 1e-6
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [1, 4, 32, 33])
@pytest.mark.parametrize("experts", [128, 160])
def test_router_logits_kernel_matches_its_reference(rows, experts):
    """GLM-4.5's fp32 router (hidden 4096, 128 or 160 experts) on a step's bf16 rows; 33 rows take the reference."""
    g = torch.Generator(device="cuda").manual_seed(rows + experts)
    x = torch.randn(rows, 4096, device="cuda", generator=g).bfloat16()
    weight = torch.randn(experts, 4096, device="cuda", generator=g) * 0.02
    out, ref = router_logits(x, weight), router_logits_ref(x, weight)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", MOE_FAMILIES)
@pytest.mark.parametrize("kind", ["plain", "eagle3", "tree", "dynamic"])
def test_graphed_greedy_is_lossless_fp32(arch, kind):
    target, head = tiny_pair(arch)
    model = SpecModel.from_pretrained(target, spec(kind, head), dtype=torch.float32, device="cuda", max_batch_size=8,
                                      compile_step=False)
    assert any(isinstance(m, MoE) for m in model.target.fused.modules())
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    assert model.runner.graph_runner.graphs, "no CUDA graph was used"
    for prompt, n, out in zip(PROMPTS, MAX_NEW, outs):
        assert out.token_ids == hf_greedy(target, prompt, n), prompt


@pytest.mark.parametrize("mode", ["eagle_k3", "vanilla3"])
def test_glm_mtp_moe_blocks_in_graphs_are_lossless(mode):
    target = mtp_target("glm4_moe", "deepseek")
    model = SpecModel.from_pretrained(target, MODES[mode], dtype=torch.float32, device="cuda", max_batch_size=8,
                                      compile_step=False)
    assert any(isinstance(m, MoE) for m in model.worker.draft_model.modules())  # the MTP block is fused too
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    assert model.runner.graph_runner.graphs
    for prompt, n, out in zip(PROMPTS, MAX_NEW, outs):
        assert out.token_ids == hf_greedy(target, prompt, n), prompt


@pytest.mark.parametrize("arch", MOE_FAMILIES)
def test_bf16_speculation_equals_the_targets_own_greedy(arch):
    target, head = tiny_pair(arch)
    params = [SamplingParams(max_new_tokens=n) for n in MAX_NEW]
    outputs = {}
    for kind in ("plain", "eagle3"):
        model = SpecModel.from_pretrained(target, spec(kind, head), dtype=torch.bfloat16, device="cuda",
                                          max_batch_size=8, compile_step=False)
        outputs[kind] = [o.token_ids for o in model.generate(PROMPTS, params)]
    assert outputs["eagle3"] == outputs["plain"]


@pytest.mark.parametrize("arch", MOE_FAMILIES)
def test_no_host_sync_inside_the_generation_step(arch):
    target, head = tiny_pair(arch)
    model = SpecModel.from_pretrained(target, eagle3(head, 3), dtype=torch.bfloat16, device="cuda",
                                      max_batch_size=8, enforce_eager=True)
    assert_no_host_sync_in_generation_steps(model, PROMPTS[:3])


@pytest.mark.compiles
def test_the_step_compiled_whole_is_lossless(monkeypatch):
    monkeypatch.setenv(trace_cache.TRACE_CACHE_VAR, "0")  # traced here
    target, head = tiny_pair("glm4_moe")
    model = SpecModel.from_pretrained(target, eagle3(head, 3), dtype=torch.float32, device="cuda", max_batch_size=8,
                                      compile_step=True)
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    for prompt, n, out in zip(PROMPTS, MAX_NEW, outs):
        assert out.token_ids == hf_greedy(target, prompt, n), prompt


def test_graphed_sampling_keeps_the_targets_distribution():
    from ..sampling.test_distribution import V, exact_joint, pvalue, sample_pairs

    target, head = tiny_pair("qwen3_moe", vocab_size=V, seed=4)
    cfg = Eagle3Config(speculative_model=str(head), max_draft_len=3, use_rejection_sampling=True)
    model = SpecModel.from_pretrained(target, cfg, dtype=torch.float32, device="cuda", max_batch_size=64,
                                      compile_step=False)
    counts, stats = sample_pairs(model, 1.0, seed=3)
    assert pvalue(counts, exact_joint(target, 1.0)) > 1e-3
    assert stats["acceptance_rate_per_position"][0] > 0.005
