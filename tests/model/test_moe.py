"""Mixture-of-experts targets in the fused path (Qwen3-MoE, GLM-4.5, Mixtral): routing and experts equal to the
stock modules, greedy speculative output equal to the target's own, unsupported variants refused in one line."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from tllm_spec import SamplingParams
from tllm_spec.config import Eagle3Config
from tllm_spec.model.decoder import FusedDecoder, is_moe
from tllm_spec.model.moe import MoE
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.random_models import save_random_target, target_config

from ..models import ARCH_OVERRIDES, MOE_FAMILIES, eagle3, hf_greedy, tiny_pair

PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
MAX_NEW = [14, 9, 17]


def _stock_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(target_config(arch, **ARCH_OVERRIDES[arch])).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 1.0 / param.shape[-1] ** 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM's choice bias, which the weights leave out
                buffer.normal_(0.0, 0.1)
    return model


def _moe_layers(model) -> list[tuple[torch.nn.Module, MoE]]:
    """(stock block, fused MoE) of every MoE layer of ``model``."""
    fused = FusedDecoder.from_hf(model, 64)
    assert fused is not None
    return [(layer.mlp, fused_layer.mlp) for layer, fused_layer in zip(model.model.layers, fused.layers)
            if isinstance(fused_layer.mlp, MoE)]


@pytest.mark.parametrize("arch", MOE_FAMILIES)
def test_routing_and_experts_equal_the_stock_block(arch):
    model = _stock_model(arch)
    layers = _moe_layers(model)
    assert layers and is_moe(model)
    x = torch.randn(11, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for stock, moe in layers:
        _, weights, ids = stock.gate(x)
        ours_w, ours_ids = moe.route(x)
        order, ours_order = ids.sort(dim=-1), ours_ids.long().sort(dim=-1)  # the same experts, any order
        assert torch.equal(order.values, ours_order.values)
        torch.testing.assert_close(weights.float().gather(1, order.indices), ours_w.gather(1, ours_order.indices))
        torch.testing.assert_close(moe(x), stock(x[None])[0], atol=1e-5, rtol=1e-5)


def test_glm_group_routing_keeps_to_the_best_groups():
    model = _stock_model("glm4_moe")
    (_, moe), *_ = _moe_layers(model)
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    _, ids = moe.route(x)
    groups = (ids // (moe.num_experts // moe.n_group)).long()
    assert moe.n_group == 2 and moe.topk_group == 1
    assert (groups == groups[:, :1]).all()  # top-1 group of 2: every chosen expert in one group
    assert len(set(groups[:, 0].tolist())) == 2  # and both groups are chosen by some token


@pytest.mark.parametrize("arch", MOE_FAMILIES)
def test_eagle3_greedy_equals_the_targets_own(arch):
    target, head = tiny_pair(arch)
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=3)
    assert model.target.fused is not None and any(isinstance(m, MoE) for m in model.target.fused.modules())
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    for prompt, n, out in zip(PROMPTS, MAX_NEW, outs):
        assert out.token_ids == hf_greedy(target, prompt, n), f"prompt {prompt}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_FAMILIES)
@pytest.mark.parametrize("spec", ["plain", "static_tree", "dynamic_tree", "k1_batch1"])
def test_every_draft_kind_on_moe_targets(arch, spec):
    target, head = tiny_pair(arch)
    batch = 1 if spec == "k1_batch1" else 3
    config = {"plain": None, "k1_batch1": eagle3(head, 1),
              "static_tree": Eagle3Config(speculative_model=str(head), max_draft_len=3,
                                          eagle_choices=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
              "dynamic_tree": Eagle3Config(speculative_model=str(head), max_draft_len=3, use_dynamic_tree=True,
                                           dynamic_tree_max_topK=2, max_total_draft_tokens=6)}[spec]
    model = SpecModel.from_pretrained(target, config, max_batch_size=batch)
    outs = model.generate(PROMPTS[:batch], [SamplingParams(max_new_tokens=n) for n in MAX_NEW[:batch]])
    for prompt, n, out in zip(PROMPTS, MAX_NEW, outs):
        assert out.token_ids == hf_greedy(target, prompt, n), f"prompt {prompt}"


def test_stock_modules_on_the_cpu_equal_the_fused_path():
    target, head = tiny_pair("qwen3_moe")
    stock = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=3, use_fused_layers=False)
    assert stock.target.fused is None
    outs = stock.generate(PROMPTS[:2], SamplingParams(max_new_tokens=8))
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, 8) for p in PROMPTS[:2]]


@pytest.mark.parametrize("model_type, fields, match", [
    ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32), "Qwen2MoeSparseMoeBlock is not one of the supported"),
    ("deepseek_v3", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=16,
                         q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                         first_k_dense_replace=1, n_group=1, topk_group=1), "MLA attention"),
])
def test_unsupported_moe_variants_are_refused_naming_what_is_missing(tmp_path, model_type, fields, match):
    config = target_config(model_type, num_hidden_layers=2, **fields)
    target = save_random_target(tmp_path / model_type, config)
    with pytest.raises(NotImplementedError, match=match):
        SpecModel.from_pretrained(target, None, max_batch_size=1)
