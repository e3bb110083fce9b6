"""The named shapes: each builds the architecture its name says with the published config's fields (the big ones
on the meta device, counted against the published parameter totals), and what is built from a shape (the EAGLE-3
head, MTP modules, the tiny MoE targets) keeps working."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from tllm_spec.drafts.mtp.model import MTPModule, random_mtp_modules
from tllm_spec.tools.random_models import (
    SHAPES,
    is_moe_shape,
    random_head_for,
    shape_config,
)

ROPE_FIELDS = ("rope_theta", "partial_rotary_factor")  # transformers 5 keeps these in config.rope_parameters
READ_BY_GETATTR = ("head_dim",)  # no declared field of Qwen3MoeConfig / Glm4MoeConfig: the attention reads it


def meta_model(shape: str) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(shape_config(shape))


def billions(module: torch.nn.Module, exclude: str | None = None) -> float:
    return sum(p.numel() for name, p in module.named_parameters() if exclude is None or exclude not in name) / 1e9


CONFIG_CLASSES = {"qwen3-30b-a3b": "Qwen3MoeConfig", "glm-4.5-air": "Glm4MoeConfig", "mixtral-8x7b": "MixtralConfig",
                  "tiny-qwen3-moe": "Qwen3MoeConfig", "tiny-glm4-moe": "Glm4MoeConfig", "tiny-mixtral": "MixtralConfig",
                  "llama-3.1-8b": "LlamaConfig", "qwen3-8b": "Qwen3Config"}


@pytest.mark.parametrize("shape, config_class", CONFIG_CLASSES.items())
def test_every_field_of_a_shape_is_one_its_config_class_reads(shape, config_class):
    """A misspelt field would be kept as a stray attribute and change nothing: each must be a declared field of the
    class (or an alias of one), a RoPE parameter, or one the modeling code reads with getattr."""
    config = shape_config(shape)
    assert type(config).__name__ == config_class and is_moe_shape(shape) == ("Moe" in config_class
                                                                              or "Mixtral" in config_class)
    declared = {f.name for f in dataclasses.fields(type(config))} | set(type(config).attribute_map) | set(
        type(config).attribute_map.values())
    for key, value in SHAPES[shape].items():
        if key in ROPE_FIELDS:
            assert config.rope_parameters[key] == value, key
            continue
        assert key in declared or key in READ_BY_GETATTR, f"{shape}: {key} is not a {config_class} field"
        assert getattr(config, key) == value, key


def test_qwen3_30b_a3b_has_its_published_size():
    model = meta_model("qwen3-30b-a3b")
    experts = billions(model) - billions(model, exclude=".experts.")
    assert billions(model) == pytest.approx(30.53, abs=0.01)  # 30.5 B in total
    assert billions(model) - experts + experts * 8 / 128 == pytest.approx(3.35, abs=0.01)  # 3.3 B active
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.out_features == 32 * 128 and attn.k_proj.out_features == 4 * 128  # head_dim 128, not 64
    assert all(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in model.model.layers)
    assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape) == (128, 2 * 768, 2048)


def test_mixtral_8x7b_has_its_published_size():
    model = meta_model("mixtral-8x7b")
    assert billions(model) == pytest.approx(46.70, abs=0.01)
    experts = billions(model) - billions(model, exclude=".experts.")
    assert billions(model) - experts + experts * 2 / 8 == pytest.approx(12.88, abs=0.01)  # 12.9 B active


def test_glm_4_5_air_has_its_published_size_with_its_mtp_layer():
    """106.9 B in the decoder; the checkpoint's 110.5 B add the MTP layer (its own block, eh_proj and norms, 2.4 B)
    and that layer's copies of the embedding and output head."""
    model = meta_model("glm-4.5-air")
    config = model.config
    assert billions(model) == pytest.approx(106.85, abs=0.01)
    layers = model.model.layers
    assert type(layers[0].mlp).__name__ == "Glm4MoeMLP" and layers[0].mlp.gate_proj.out_features == 10944
    assert all(type(layer.mlp).__name__ == "Glm4MoeMoE" for layer in layers[1:])
    assert layers[0].self_attn.q_proj.bias is not None and layers[0].self_attn.q_proj.out_features == 96 * 128
    with torch.device("meta"):
        mtp = MTPModule(config, type(layers[0]), type(model.model.norm), config.num_hidden_layers)
    copies = 2 * config.vocab_size * config.hidden_size / 1e9
    assert billions(model) + billions(mtp) + copies == pytest.approx(110.47, abs=0.01)
    assert config.num_nextn_predict_layers == 1


@pytest.mark.parametrize("shape, dense_intermediate", [("tiny-qwen3-moe", 128), ("tiny-glm4-moe", 128),
                                                       ("tiny-mixtral", 32)])
def test_an_eagle3_head_for_a_moe_shape_takes_its_dense_intermediate_size(shape, dense_intermediate):
    config = shape_config(shape)
    head = random_head_for(config, draft_vocab_size=64).config.llama_config
    assert head.intermediate_size == dense_intermediate != getattr(config, "moe_intermediate_size", 0)
    assert head.head_dim == 16 and head.num_key_value_heads == 2


def test_random_mtp_modules_for_a_glm_moe_shape():
    """GLM-4.5's MTP layer is a MoE block of the target's own layer class."""
    config = shape_config("tiny-glm4-moe")
    (state,) = random_mtp_modules(config, config.num_nextn_predict_layers)
    assert tuple(state["mlp.experts.gate_up_proj"].shape) == (8, 2 * 32, 64)
    assert tuple(state["eh_proj.weight"].shape) == (64, 128) and "mlp.shared_experts.up_proj.weight" in state


def test_random_mtp_modules_drawn_in_a_dtype_from_a_meta_module():
    """The benchmark draws GLM-4.5-Air's MTP module (2.4 B parameters) in bf16 on its GPU: no fp32 module on the
    CPU first. The default (fp32 on the CPU) draws the same numbers as before, which bf16 rounds."""
    config = shape_config("tiny-glm4-moe")
    (fp32,) = random_mtp_modules(config, 1, seed=3)
    (bf16,) = random_mtp_modules(config, 1, seed=3, dtype=torch.bfloat16, device="cpu")
    assert fp32.keys() == bf16.keys() and all(v.dtype == torch.bfloat16 for v in bf16.values())
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in fp32.values())
    noise = torch.randn(64, generator=torch.Generator().manual_seed(3), dtype=torch.bfloat16)  # the first tensor
    assert torch.equal(bf16["enorm.weight"], noise.mul_(0.1).add_(1.0))


def test_save_random_mtp_writes_an_mtp_checkpoint_of_the_shape(tmp_path):
    from tllm_spec.drafts.mtp.checkpoint import load_mtp_checkpoint
    from tllm_spec.tools.random_models import save_random_mtp

    config = shape_config("tiny-glm4-moe")
    path = save_random_mtp(tmp_path / "mtp", config, seed=2, dtype=torch.bfloat16)
    (state,) = random_mtp_modules(config, 1, seed=2, dtype=torch.bfloat16)
    ckpt = load_mtp_checkpoint(path, config.num_hidden_layers, 1)
    assert ckpt.layout == "deepseek" and ckpt.modules[0].keys() == state.keys()
    assert all(torch.equal(ckpt.modules[0][k], v) for k, v in state.items())
    assert (path / "config.json").is_file()
    assert save_random_mtp(path, config, seed=2) == path  # written again over the first: one module still
    assert len(load_mtp_checkpoint(path, config.num_hidden_layers, 1).modules) == 1


def test_random_spec_model_with_an_mtp_module_on_a_target_without_a_checkpoint(tmp_path):
    """The benchmark's --mtp: a random MTP module loaded through the real loader for a target built in memory;
    greedy output is the target's own."""
    from tllm_spec.config import SamplingParams
    from tllm_spec.spec_model import SpecModel
    from tllm_spec.tools.random_models import random_spec_model

    model = random_spec_model("tiny-glm4-moe", "mtp", 3, tmp_path, torch.float32, "cpu", max_batch_size=2)
    assert model.target.checkpoint_dir is None and model.max_draft_len == 3
    (module,) = model.worker.draft_model.mtp_modules
    assert module.kv_layer == 8 and type(module.block.mlp).__name__ == "MoE"  # GLM's MoE block, fused
    prompts, params = [[1, 2, 3, 4], [7, 8]], SamplingParams(max_new_tokens=8, ignore_eos=True)
    plain = SpecModel.from_target(model.target, None, max_batch_size=2)
    assert [o.token_ids for o in model.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts,
                                                                                                          params)]
