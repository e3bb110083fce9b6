"""The HF generate baseline on the CPU: a MoE target's experts run through the transformers implementation asked
for (the stock loop over experts for "eager") and its row says so; the target's own settings come back after.
Its rate is not asserted (a benchmark, not a test)."""
from __future__ import annotations

import torch

from tllm_spec.model.target import TargetModel
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.hf_generate import hf_generate_row
from tllm_spec.tools.random_models import shape_config


def plain_model(shape: str) -> SpecModel:
    return SpecModel.from_target(TargetModel.from_config(shape_config(shape), torch.float32, "cpu"), None)


def test_hf_generate_of_a_moe_target_runs_the_stock_expert_loop_and_says_so():
    model = plain_model("tiny-mixtral")
    hf = model.target.hf
    seen = []
    hf.register_forward_pre_hook(lambda module, args: seen.append((hf.config._experts_implementation,
                                                                   hf.config._attn_implementation)))
    row = hf_generate_row(model, batch=2, prompt_len=4, new_tokens=6, static_cache=False,
                          experts_implementation="eager")
    assert set(seen) == {("eager", "sdpa")}
    assert row["experts_implementation"] == "eager" and row["batch"] == 2 and "tokens_per_second" in row
    assert row["path"] == ("HF generate: stock modules, sdpa attention, dynamic cache, experts_implementation=eager "
                           "(the stock loop over experts)")
    assert (hf.config._experts_implementation, hf.config._attn_implementation) == ("grouped_mm", "tllm_spec")
    assert hf_generate_row(model, 1, 4, 6, False)["experts_implementation"] == "grouped_mm"  # transformers' choice


def test_hf_generate_of_a_dense_target_names_no_experts():
    row = hf_generate_row(plain_model("tiny"), batch=1, prompt_len=4, new_tokens=6, static_cache=False)
    assert row["experts_implementation"] is None
    assert row["path"] == "HF generate: stock modules, sdpa attention, dynamic cache"
