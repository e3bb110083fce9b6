"""The draft LM (DRAFT_TARGET_ONE_MODEL), suffix drafting (SA) and SA on a head in CUDA graphs: greedy equals the
target's (eager kernels captured, and the step compiled whole), a target drafting for itself accepts every draft,
no host synchronisation inside the step, sampled output keeps the target's distribution."""
import pytest
import torch

from tllm_spec import DraftTargetConfig, Eagle3Config, MTPConfig, SAConfig, SamplingParams, trace_cache
from tllm_spec.engine.cuda_graphs import generation_step
from tllm_spec.spec_model import SpecModel

from ..drafts.test_sa import PROMPTS as SA_PROMPTS
from ..models import hf_greedy, tiny_draft_lm, tiny_pair
from ..test_mtp_lossless import mtp_target
from .test_engine_gpu import MAX_NEW, PROMPTS, assert_no_host_sync_in_generation_steps

pytestmark = pytest.mark.cuda


def spec_for(kind: str, target, head, k: int = 3):
    return {"self_draft": lambda: DraftTargetConfig(speculative_model=str(target), max_draft_len=k),
            "draft_lm": lambda: DraftTargetConfig(speculative_model=str(tiny_draft_lm("llama")), max_draft_len=k),
            "sa": lambda: SAConfig(max_draft_len=k),
            "sa_pool": lambda: SAConfig(max_draft_len=k, enable_global_pool=True, global_pool_size=4096),
            "eagle3+sa": lambda: Eagle3Config(speculative_model=str(head), max_draft_len=k, use_sa_spec=True,
                                              sa_spec_threshold=2)}[kind]()


def build(kind: str, k: int = 3, dtype=torch.float32, **kw):
    if kind == "mtp+sa":
        target = mtp_target("llama", "deepseek")
        cfg = MTPConfig(num_nextn_predict_layers=1, max_draft_len=k, use_sa_spec=True, sa_spec_threshold=2)
    else:
        target, head = tiny_pair("llama")
        cfg = spec_for(kind, target, head, k)
    return target, SpecModel.from_pretrained(target, cfg, dtype=dtype, device="cuda", max_batch_size=8,
                                             **{"compile_step": False, **kw})


def check_lossless(target, model, prompts=PROMPTS, max_new=MAX_NEW):
    outs = model.generate(prompts, [SamplingParams(max_new_tokens=n) for n in max_new])
    assert model.runner.graph_runner is not None and model.runner.graph_runner.graphs, "no CUDA graph was used"
    for prompt, n, out in zip(prompts, max_new, outs):
        assert out.token_ids == hf_greedy(target, prompt, n), prompt
    return outs


@pytest.mark.parametrize("kind", ["self_draft", "draft_lm", "sa", "sa_pool", "eagle3+sa", "mtp+sa"])
@pytest.mark.parametrize("k", [1, 4])
def test_graphed_greedy_is_lossless_fp32(kind, k):
    target, model = build(kind, k)
    outs = check_lossless(target, model, SA_PROMPTS + PROMPTS[3:], [40, 30, 37] + MAX_NEW[3:])
    if kind == "self_draft":
        for out in outs:
            assert all(n == k + 1 for n in out.stats.accepted_per_step[:-1]), out.stats.accepted_per_step


def test_the_global_pool_drafts_a_repeated_request_in_graphs():
    target, model = build("sa_pool", 4)
    prompt, n = [12, 8, 40, 41, 3], 40
    first = model.generate([prompt], SamplingParams(max_new_tokens=n))[0]
    again = model.generate([prompt], SamplingParams(max_new_tokens=n))[0]
    assert first.token_ids == again.token_ids == hf_greedy(target, prompt, n)
    assert again.stats.accepted_per_step[1:-1] == [5] * (len(again.stats.accepted_per_step) - 2)


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_sa_on_a_tree_in_graphs_is_lossless(tree):
    from tllm_spec.drafts.tree import DEFAULT_EAGLE_CHOICES

    target, head = tiny_pair("llama")
    fields = dict(eagle_choices=DEFAULT_EAGLE_CHOICES, max_draft_len=7) if tree == "static" else dict(
        use_dynamic_tree=True, dynamic_tree_max_topK=3, max_total_draft_tokens=25, max_draft_len=8)
    cfg = Eagle3Config(speculative_model=str(head), use_sa_spec=True, sa_spec_threshold=2, **fields)
    model = SpecModel.from_pretrained(target, cfg, dtype=torch.float32, device="cuda", max_batch_size=8,
                                      compile_step=False)
    check_lossless(target, model, SA_PROMPTS + PROMPTS[3:], [40, 30, 37] + MAX_NEW[3:])


def test_draft_lm_with_chunked_prefill_in_graphs():
    target, model = build("self_draft", 3, max_num_batched_tokens=8)
    prompts = [list(range(1, 40)), [7] * 23, [3, 4]]
    for out in check_lossless(target, model, prompts, [20, 12, 15]):
        assert all(n == 4 for n in out.stats.accepted_per_step[:-1])


@pytest.mark.compiles
@pytest.mark.parametrize("kind", ["self_draft", "sa"])
def test_the_step_compiled_whole_is_lossless(kind, monkeypatch):
    monkeypatch.setenv(trace_cache.TRACE_CACHE_VAR, "0")  # traced here
    target, model = build(kind, 3, compile_step=True)
    assert model.runner.compiles_step_whole and model.runner.graph_runner.step is not generation_step
    check_lossless(target, model)


@pytest.mark.parametrize("kind", ["self_draft", "sa", "eagle3+sa"])
def test_no_host_sync_inside_the_generation_step(kind):
    assert_no_host_sync_in_generation_steps(build(kind, 3, enforce_eager=True)[1], SA_PROMPTS[:2])


@pytest.mark.parametrize("kind", ["draft_lm", "sa"])
def test_graphed_sampling_keeps_the_targets_distribution(kind):
    from ..sampling.test_distribution import V, exact_joint, pvalue, sample_pairs

    target, _ = tiny_pair("llama", vocab_size=V, seed=4)
    cfg = SAConfig(max_draft_len=3) if kind == "sa" else DraftTargetConfig(
        speculative_model=str(tiny_draft_lm("llama", vocab_size=V)), max_draft_len=3, use_rejection_sampling=True)
    model = SpecModel.from_pretrained(target, cfg, dtype=torch.float32, device="cuda", max_batch_size=64,
                                      compile_step=False)
    counts, stats = sample_pairs(model, 1.0, seed=3)
    assert pvalue(counts, exact_joint(target, 1.0)) > 1e-3
    assert stats["acceptance_rate_per_position"][0] > 0.005
