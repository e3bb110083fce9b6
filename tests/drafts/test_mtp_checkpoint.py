"""MTP checkpoint layouts: each public layout loads to the same module; bad checkpoints fail naming the tensor."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tllm_spec import MTPConfig, SamplingParams
from tllm_spec.drafts.mtp.checkpoint import LAYOUTS, load_mtp_checkpoint, save_mtp_weights
from tllm_spec.drafts.mtp.model import random_mtp_modules, save_random_mtp_weights
from tllm_spec.drafts.mtp.worker import build_mtp_worker
from tllm_spec.model.target import TargetModel
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.random_models import save_random_target, target_config

from ..models import hf_greedy

L = 8  # decoder layers of the tiny targets


def shared_own_keys(states):
    """Qwen3-Next stores fc and the three norms once for all modules: make the modules agree on them."""
    return [{**s, **{k: states[0][k] for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                 "shared_head.norm.weight")}} for s in states]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_layout_loads_to_the_same_modules(tmp_path, arch):
    states = shared_own_keys(random_mtp_modules(target_config(arch), 2, seed=5))
    for layout in LAYOUTS:
        save_mtp_weights(tmp_path / layout, states, layout, num_target_layers=L)
        ckpt = load_mtp_checkpoint(tmp_path / layout, L, 2)
        assert ckpt.layout == layout and len(ckpt.modules) == 2
        for want, got in zip(states, ckpt.modules):
            assert want.keys() == got.keys()
            for key in want:  # exact, except the Qwen3-Next (1+w) norms round-trip through w - 1
                torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6 if layout == "qwen3_next" else 0)


def test_layouts_on_disk_follow_the_public_formats(tmp_path):
    state = random_mtp_modules(target_config("qwen2"), 1, seed=6)[0]
    hidden = state["hnorm.weight"].shape[0]
    for layout in LAYOUTS:
        save_mtp_weights(tmp_path / layout, [state], layout, num_target_layers=L)
    deepseek = load_file(tmp_path / "deepseek" / "model-mtp.safetensors")
    assert torch.equal(deepseek[f"model.layers.{L}.eh_proj.weight"], state["eh_proj.weight"])
    assert torch.equal(deepseek[f"model.layers.{L}.self_attn.q_proj.bias"], state["self_attn.q_proj.bias"])
    mimo = load_file(tmp_path / "mimo" / "model-mtp.safetensors")  # input_proj reads cat(hidden, embedding)
    assert torch.equal(mimo["model.mtp_layers.0.input_proj.weight"][:, :hidden], state["eh_proj.weight"][:, hidden:])
    assert torch.equal(mimo["model.mtp_layers.0.token_layernorm.weight"], state["enorm.weight"])
    assert torch.equal(mimo["model.mtp_layers.0.final_layernorm.weight"], state["shared_head.norm.weight"])
    qwen = load_file(tmp_path / "qwen3_next" / "model-mtp.safetensors")  # norms stored as w - 1
    torch.testing.assert_close(qwen["mtp.pre_fc_norm_hidden.weight"] + 1, state["hnorm.weight"])
    torch.testing.assert_close(qwen["mtp.layers.0.input_layernorm.weight"] + 1, state["input_layernorm.weight"])
    assert torch.equal(qwen["mtp.fc.weight"], state["eh_proj.weight"])


def test_appended_shard_keeps_the_target_loadable(tmp_path):
    save_random_target(tmp_path, target_config("llama"))
    save_random_mtp_weights(tmp_path, 2, "mimo")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 2
    model = SpecModel.from_pretrained(tmp_path, MTPConfig(num_nextn_predict_layers=2, use_mtp_vanilla=True),
                                      max_batch_size=1)
    assert model.generate([[3, 4, 5]], SamplingParams(max_new_tokens=5))[0].token_ids == \
        hf_greedy(tmp_path, [3, 4, 5], 5)


def test_separate_mtp_checkpoint_path(tmp_path):
    config = target_config("llama")
    save_random_target(tmp_path / "target", config)
    save_mtp_weights(tmp_path / "mtp", random_mtp_modules(config, 1, seed=2), "deepseek", num_target_layers=L)
    model = SpecModel.from_pretrained(tmp_path / "target", MTPConfig(mtp_checkpoint=str(tmp_path / "mtp"),
                                                                     max_draft_len=2), max_batch_size=1)
    out = model.generate([[3, 4, 5]], SamplingParams(max_new_tokens=6))[0]
    assert out.token_ids == hf_greedy(tmp_path / "target", [3, 4, 5], 6)
    with pytest.raises(ValueError, match="no MTP tensors"):  # the target dir itself carries none
        SpecModel.from_pretrained(tmp_path / "target", MTPConfig())


@pytest.fixture(scope="module")
def random_target():
    return TargetModel.from_config(target_config("qwen2"), torch.float32, "cpu")


def build(path, random_target, **cfg):
    return build_mtp_worker(random_target, MTPConfig(mtp_checkpoint=str(path), **cfg), max_batch_size=2)


def write_deepseek(path, edit):
    """One DeepSeek-layout module for the tiny Qwen2 target, with ``edit(tensors)`` applied on disk."""
    save_mtp_weights(path, random_mtp_modules(target_config("qwen2"), 1), "deepseek", num_target_layers=L)
    rewrite_shard(path, edit)


def rewrite_shard(path, edit) -> None:
    """Apply ``edit(tensors)`` to the MTP shard save_mtp_weights wrote in ``path``, keeping the index in step."""
    tensors = load_file(path / "model-mtp.safetensors")
    edit(tensors)
    save_file(tensors, path / "model-mtp.safetensors")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = dict.fromkeys(tensors, "model-mtp.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("edit,error,match", [
    (lambda t: t.pop(f"model.layers.{L}.hnorm.weight"), ValueError, rf"model\.layers\.{L}\.hnorm\.weight: required"),
    (lambda t: t.pop(f"model.layers.{L}.self_attn.k_proj.bias"), ValueError,
     rf"model\.layers\.{L}\.self_attn\.k_proj\.bias: required"),
    (lambda t: t.update({f"model.layers.{L}.eh_proj.weight": torch.zeros(64, 64)}), ValueError,
     rf"model\.layers\.{L}\.eh_proj\.weight: expected shape \[64, 128\], found \[64, 64\]"),
    (lambda t: t.update({f"model.layers.{L}.self_attn.q_norm.weight": torch.ones(16)}), ValueError,
     rf"model\.layers\.{L}\.self_attn\.q_norm\.weight: unexpected"),
    # MoE experts for a dense target's block: fused on reading, then unexpected
    (lambda t: t.update({f"model.layers.{L}.mlp.experts.0.{p}.weight": torch.zeros(4, 64) for p in
                         ("gate_proj", "up_proj", "down_proj")}),
     ValueError, rf"model\.layers\.{L}\.mlp\.experts\.(gate_up|down)_proj: unexpected tensor"),
    (lambda t: t.update({f"model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight": torch.zeros(4, 64)}),
     NotImplementedError, r"kv_a_proj_with_mqa\.weight: MLA attention MTP blocks .* \(a later issue\)"),
    (lambda t: t.update({f"model.layers.{L}.eh_proj.weight": torch.zeros(64, 128).to(torch.float8_e4m3fn)}),
     NotImplementedError, rf"model\.layers\.{L}\.eh_proj\.weight: MTP modules stored in FP8 are not supported"),
    (lambda t: t.update({"model.layers.3.eh_proj.weight": torch.zeros(64, 128)}), ValueError,
     r"model\.layers\.3\.eh_proj\.weight: an MTP tensor inside the target's 8 decoder layers"),
    (lambda t: t.update({"mtp.fc.weight": torch.zeros(64, 128)}), ValueError, r"several layouts"),
    (lambda t: t.update({f"model.layers.{L}.shared_head.head.weight": torch.zeros(96, 64)}), ValueError,
     rf"model\.layers\.{L}\.shared_head\.head\.weight: expected shape \[97, 64\]"),
])
def test_bad_checkpoints_name_the_tensor(tmp_path, random_target, edit, error, match):
    write_deepseek(tmp_path, edit)
    with pytest.raises(error, match=match):
        build(tmp_path, random_target)


def test_too_few_modules_and_gaps(tmp_path, random_target):
    states = random_mtp_modules(target_config("qwen2"), 2)
    save_mtp_weights(tmp_path / "two", states, "mimo", num_target_layers=L)
    with pytest.raises(ValueError, match=r"2 MTP module\(s\) \(mimo layout\), num_nextn_predict_layers asks for 3"):
        build(tmp_path / "two", random_target, num_nextn_predict_layers=3, use_mtp_vanilla=True)
    save_mtp_weights(tmp_path / "gap", [{}, states[1]], "mimo", num_target_layers=L)  # module 0 written empty
    with pytest.raises(ValueError, match=r"MTP modules \[1\] \(mimo layout\) are not numbered 0\.\.0"):
        build(tmp_path / "gap", random_target)


def test_target_without_directory_needs_mtp_checkpoint(random_target):
    with pytest.raises(ValueError, match="set MTPConfig.mtp_checkpoint"):
        build_mtp_worker(random_target, MTPConfig(), max_batch_size=1)


def test_module_head_is_used_when_distinct_and_shared_when_a_copy(tmp_path, random_target):
    """DeepSeek-V3 stores a copy of lm_head as shared_head.head (kept once, the target's); a distinct head
    (Step-3.5) is loaded and produces the module's logits."""
    lm_head = random_target.lm_head.weight.detach()
    own = torch.randn_like(lm_head)
    write_deepseek(tmp_path / "copy", lambda t: t.update({f"model.layers.{L}.shared_head.head.weight": lm_head}))
    write_deepseek(tmp_path / "own", lambda t: t.update({f"model.layers.{L}.shared_head.head.weight": own}))
    copied, owned = build(tmp_path / "copy", random_target).draft_model, build(tmp_path / "own", random_target).draft_model
    assert "head" not in copied.mtp_modules[0].shared_head
    assert torch.equal(owned.mtp_modules[0].shared_head["head"].weight, own)
    hidden = torch.randn(3, lm_head.shape[1])
    normed = owned.mtp_modules[0].shared_head["norm"](hidden)
    torch.testing.assert_close(owned.compute_logits(0, hidden), normed @ own.T)
    torch.testing.assert_close(copied.compute_logits(0, hidden),
                               copied.mtp_modules[0].shared_head["norm"](hidden) @ lm_head.T)
