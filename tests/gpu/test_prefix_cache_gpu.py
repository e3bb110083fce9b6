"""Prefix caching on the GPU (on by default there), CUDA graphs and the compiled step: requests behind a shared
prefix reuse its pages and decode exactly what the target decodes greedily, with every drafter; the same
prompts with the cache off give the same tokens and the same acceptance."""
import pytest
import torch

from tllm_spec import DraftTargetConfig, Eagle3Config, SAConfig, SamplingParams, SpecModel

from ..engine.test_prefix_cache import expected_hit, mtp_target
from ..models import hf_greedy, tiny_draft_lm, tiny_pair

pytestmark = pytest.mark.cuda

SHARED = list(range(3, 60))  # 57 tokens: 3 pages of 16 and a partial one
PROMPTS = [SHARED + [61, 62], SHARED[:16] + [7], SHARED + [70, 71, 72, 73] * 5, SHARED[:40]]


def spec(kind: str):
    from tllm_spec import MTPConfig

    target, head = tiny_pair("llama")
    return {
        "eagle3": (target, Eagle3Config(speculative_model=str(head), max_draft_len=3)),
        "tree": (target, Eagle3Config(speculative_model=str(head), max_draft_len=2,
                                      eagle_choices=[[0], [1], [0, 0], [0, 1], [1, 0]])),
        "draft_target": (target, DraftTargetConfig(speculative_model=str(tiny_draft_lm("llama")), max_draft_len=3)),
        "sa": (target, SAConfig(max_draft_len=4)),
        "vanilla3": (mtp_target(), MTPConfig(num_nextn_predict_layers=3, use_mtp_vanilla=True)),
    }[kind]


@pytest.mark.parametrize("kind", ["eagle3", "tree", "draft_target", "sa", "vanilla3"])
def test_reused_prefix_is_lossless_fp32(kind):
    target, config = spec(kind)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    outs = {}
    for cache in (True, False):
        model = SpecModel.from_pretrained(target, config, dtype=torch.float32, device="cuda", max_batch_size=4,
                                          enable_prefix_caching=cache, admission_window_ms=0.0)
        assert model.engine.prefix_cache.enabled == cache
        model.generate([SHARED + [90]], params)  # caches SHARED's pages
        outs[cache] = model.generate(PROMPTS, params)
        model.close()
    for prompt, on, off in zip(PROMPTS, outs[True], outs[False]):
        assert on.token_ids == off.token_ids == hf_greedy(target, prompt, 24)
        assert on.stats.accepted_per_step == off.stats.accepted_per_step
    expected = [expected_hit(kind, prompt, [SHARED + [90]], page=16) for prompt in PROMPTS]
    assert [o.stats.cached_prompt_tokens for o in outs[True]] == expected and sum(expected) >= 96
