"""An FP8 KV cache (``EngineConfig.kv_cache_dtype="fp8"``): the pool holds E4M3 pages with per-layer scales (the
checkpoint's ``k_scale`` / ``v_scale``, else 1.0); writes store x / scale clamped to +-448, the paged attention reads
them times the scale. Speculation over it stays lossless: the EAGLE-3 head (chain and tree) and suffix drafting each
emit exactly the tokens the target picks in the rows that verify them, and decode greedily what the same target over
the same FP8 cache decodes alone, up to FP8 rounding (a K/V value computed in a step of K + 1 rows and in a step of
one row may differ by 1e-6 on the CPU, enough to round to the neighbouring E4M3 value now and then: the outputs then
agree until a position where the target's two best tokens are that close)."""
from __future__ import annotations

from functools import cache

import pytest
import torch

from tllm_spec import Eagle3Config, EngineConfig, GenerationOutputs, SAConfig, SamplingParams, SpecModel
from tllm_spec.kernels.fp8_quant import FP8
from tllm_spec.kernels.kv_write import kv_write_ref
from tllm_spec.kernels.paged_attention import paged_attention_ref

from .test_fp8_speculation import assert_agrees_up_to_near_ties

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\nclass ", "    for key, value in "]
MAX_NEW = 24
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
SPECS = {"eagle3": Eagle3Config(speculative_model="demo://eagle3", max_draft_len=3),
         "tree": Eagle3Config(speculative_model="demo://eagle3", max_draft_len=3, eagle_choices=TREE,
                              max_total_draft_tokens=len(TREE)),
         "sa": SAConfig(max_draft_len=4)}
NOISE = 0.5  # nats, as tests/engine/test_fp8_speculation.py


def demo(spec: str | None) -> SpecModel:
    return SpecModel.from_pretrained("demo://target", SPECS[spec] if spec else None, dtype="float32", device="cpu",
                                     kv_cache_dtype="fp8", max_batch_size=3)


def test_writes_store_the_scaled_values_clamped_and_reads_scale_them_back():
    k = torch.tensor([[[1.0, -3.0, 500.0, 0.3]]]).expand(2, 1, 4).contiguous()
    v = k * -0.5
    k_cache, v_cache = (torch.zeros(3, 4, 1, 4, dtype=FP8) for _ in range(2))
    block_tables = torch.tensor([[1, 2]], dtype=torch.int32)
    kv_write_ref(k, v, k_cache, v_cache, block_tables, torch.tensor([0, 0]), torch.tensor([0, 5]), 2.0, 0.25)
    stored = k_cache[1, 0, 0].float()
    assert torch.equal(stored, torch.tensor([0.5, -1.5, 250.0, 0.15]).to(FP8).float())
    assert torch.equal(k_cache[2, 1, 0].float(), stored)  # position 5: page 2, row 1
    assert v_cache[1, 0, 0, 2].float() == -448.0  # -250 / 0.25 = -1000: clamped, not NaN
    q = torch.randn(1, 2, 4)
    out = paged_attention_ref(q, k_cache, v_cache, block_tables, torch.tensor([0]), torch.tensor([5]), 0.5, 8,
                              k_scale=2.0, v_scale=0.25)
    dequantized = paged_attention_ref(q, k_cache.float() * 2.0, v_cache.float() * 0.25, block_tables,
                                      torch.tensor([0]), torch.tensor([5]), 0.5, 8)
    torch.testing.assert_close(out, dequantized, rtol=1e-6, atol=1e-6)


def test_the_pool_is_fp8_for_target_and_draft_layers_and_the_dtype_is_checked():
    with demo("eagle3") as model:
        cache_ = model.runner.kv_cache
        assert len(cache_.k) == model.target.num_layers + 1 and {t.dtype for t in cache_.k + cache_.v} == {FP8}
        assert all(cache_.scales(i) == (1.0, 1.0) for i in range(len(cache_.k)))  # the demo stores no scales
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")


@cache
def plain() -> GenerationOutputs:
    with demo(None) as model:
        return model.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, logprobs=2))


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_speculation_over_an_fp8_kv_cache_is_lossless(spec):
    with demo(spec) as model:
        outs = model.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, logprobs=2))
    assert_agrees_up_to_near_ties(outs, plain(), NOISE, min_agreed=len(PROMPTS) * MAX_NEW * 3 / 4)
