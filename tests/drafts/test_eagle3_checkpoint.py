"""EAGLE-3 head checkpoints: dialect round trips, rope handling, and every refusal naming its culprit."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tllm_spec.drafts.eagle3.checkpoint import (
    DIALECTS,
    Eagle3Checkpoint,
    load_eagle3_checkpoint,
    save_eagle3_checkpoint,
)
from tllm_spec.tools.random_models import random_eagle3_checkpoint

VOCAB, DRAFT_VOCAB, H = 50, 20, 32


def _head(**overrides: Any) -> Eagle3Checkpoint:
    kwargs = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                  vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=(1, 5, 8))
    return random_eagle3_checkpoint(**{**kwargs, **overrides})


def _saved(tmp_path: Path, dialect: str = "eagle", **overrides: Any) -> Path:
    root = tmp_path / dialect
    save_eagle3_checkpoint(root, _head(**overrides), dialect)
    return root


def _edit_config(root: Path, edit: Callable[[dict], None]) -> None:
    config = json.loads((root / "config.json").read_text())
    edit(config)
    (root / "config.json").write_text(json.dumps(config))


def _edit_tensors(root: Path, edit: Callable[[dict], None]) -> None:
    tensors = load_file(str(root / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(root / "model.safetensors"))


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("target_hidden_size", [None, 48])
def test_round_trip(tmp_path: Path, dialect: str, target_hidden_size: int | None) -> None:
    head = _head(target_hidden_size=target_hidden_size)
    save_eagle3_checkpoint(tmp_path, head, dialect)
    loaded = load_eagle3_checkpoint(tmp_path, target_hidden_size=target_hidden_size or H, target_vocab_size=VOCAB)
    _assert_same_state(loaded.state_dict, head.state_dict)
    assert loaded.config == dataclasses.replace(head.config, dialect=dialect)


def test_dialects_share_one_canonical_state_dict(tmp_path: Path) -> None:
    head = _head()
    states = []
    for dialect in DIALECTS:
        save_eagle3_checkpoint(tmp_path / dialect, head, dialect)
        states.append(load_eagle3_checkpoint(tmp_path / dialect).state_dict)
    _assert_same_state(states[0], states[1])
    _assert_same_state(states[0], states[2])


def test_on_disk_names_follow_the_dialect(tmp_path: Path) -> None:
    for dialect in DIALECTS:
        save_eagle3_checkpoint(tmp_path / dialect, _head(), dialect)
    eagle = load_file(str(tmp_path / "eagle" / "model.safetensors"))
    spec = load_file(str(tmp_path / "speculators" / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in eagle and "layers.0.self_attn.q_proj.weight" in spec
    assert eagle["t2d"].dtype == torch.bool and int(eagle["t2d"].sum()) == DRAFT_VOCAB
    config = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert config["transformer_layer_config"]["hidden_size"] == H and "hidden_size" not in config
    assert json.loads((tmp_path / "eagle" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [1, 5, 8]
    assert load_eagle3_checkpoint(tmp_path / "angelslim").config.dialect == "angelslim"


def _biased_head_with_embedding() -> Eagle3Checkpoint:
    head = _head()
    llama = copy.deepcopy(head.config.llama_config)
    llama.attention_bias = True
    config = dataclasses.replace(head.config, llama_config=llama, has_embedding=True)
    rows = {"q": 32, "k": 16, "v": 16, "o": H}
    extra = {f"midlayer.self_attn.{p}_proj.bias": torch.randn(n) for p, n in rows.items()}
    return Eagle3Checkpoint(config, {**head.state_dict, **extra, "embed_tokens.weight": torch.randn(VOCAB, H)})


@pytest.mark.parametrize("dialect", DIALECTS)
def test_attention_bias_and_embedding_round_trip(tmp_path: Path, dialect: str) -> None:
    head = _biased_head_with_embedding()
    save_eagle3_checkpoint(tmp_path, head, dialect)
    loaded = load_eagle3_checkpoint(tmp_path)
    _assert_same_state(loaded.state_dict, head.state_dict)
    assert loaded.config == dataclasses.replace(head.config, dialect=dialect)


def test_attention_bias_requires_o_proj_bias(tmp_path: Path) -> None:
    save_eagle3_checkpoint(tmp_path, _biased_head_with_embedding(), "eagle")
    _edit_tensors(tmp_path, _del("midlayer.self_attn.o_proj.bias"))
    with pytest.raises(ValueError, match=r"midlayer\.self_attn\.o_proj\.bias: required tensor missing"):
        load_eagle3_checkpoint(tmp_path)


def test_full_vocab_head_omits_d2t_and_loads_zeros(tmp_path: Path) -> None:
    root = _saved(tmp_path, draft_vocab_size=VOCAB)
    assert "d2t" not in load_file(str(root / "model.safetensors"))
    d2t = load_eagle3_checkpoint(root).state_dict["d2t"]
    assert d2t.dtype == torch.int64 and d2t.shape == (VOCAB,) and not d2t.any()


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    root = _saved(tmp_path)
    tensors = load_file(str(root / "model.safetensors"))
    (root / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(root / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _assert_same_state(load_eagle3_checkpoint(root).state_dict, _head().state_dict)


def test_num_hidden_layers_in_config_is_ignored(tmp_path: Path) -> None:
    root = _saved(tmp_path)
    _edit_config(root, lambda c: c.update(num_hidden_layers=32))  # copied from the target
    assert load_eagle3_checkpoint(root).config.llama_config.num_hidden_layers == 1


def test_flags_and_aux_ids_are_read(tmp_path: Path) -> None:
    root = _saved(tmp_path, "speculators")
    _edit_config(root, lambda c: c.update(norm_before_residual=True))
    assert load_eagle3_checkpoint(root).config.norm_before_residual
    flat = _saved(tmp_path, "eagle", aux_layer_ids=None)
    assert load_eagle3_checkpoint(flat).config.aux_layer_ids is None
    _edit_config(flat, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 16, 29]))  # top-level variant
    assert load_eagle3_checkpoint(flat).config.aux_layer_ids == (2, 16, 29)


# ---------------------------------------------------------------- rope


def test_legacy_llama3_rope_scaling_builds_a_working_rotary_embedding(tmp_path: Path) -> None:
    root = _saved(tmp_path)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    _edit_config(root, lambda c: c.update(rope_theta=500000.0, rope_scaling=scaling, max_position_embeddings=131072))
    config = load_eagle3_checkpoint(root).config.llama_config
    assert config.rope_parameters == {**scaling, "rope_theta": 500000.0}
    rotary = LlamaRotaryEmbedding(config)
    plain = 1.0 / 500000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    assert rotary.inv_freq[0] == pytest.approx(float(plain[0]))  # high frequencies kept
    assert rotary.inv_freq[-1] == pytest.approx(float(plain[-1]) / 8.0)  # low frequencies divided by factor
    cos, sin = rotary(torch.zeros(1, 3, H), torch.arange(3)[None])
    assert cos.shape == sin.shape == (1, 3, 8)


def test_legacy_type_key_and_new_style_rope_parameters(tmp_path: Path) -> None:
    root = _saved(tmp_path)
    _edit_config(root, lambda c: c.update(rope_theta=1000.0, rope_scaling={"type": "linear", "factor": 2.0}))
    assert load_eagle3_checkpoint(root).config.llama_config.rope_parameters == {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}
    spec = _saved(tmp_path, "speculators", rope_theta=123.0)  # writes transformer_layer_config.rope_parameters
    config = load_eagle3_checkpoint(spec).config.llama_config
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 123.0}
    assert LlamaRotaryEmbedding(config).inv_freq[1] == pytest.approx(123.0 ** (-2 / 8))


# ---------------------------------------------------------------- malformed checkpoints


def _del(name: str) -> Callable[[dict], None]:
    return lambda t: t.pop(name)


def _set(name: str, value: torch.Tensor) -> Callable[[dict], None]:
    return lambda t: t.__setitem__(name, value)


@pytest.mark.parametrize("edit, match", [
    (_del("midlayer.hidden_norm.weight"), r"midlayer\.hidden_norm\.weight: required tensor missing"),
    (_del("fc.weight"), r"fc\.weight: required tensor missing"),
    (_set("midlayer.self_attn.q_proj.weight", torch.zeros(32, H)), r"q_proj\.weight: expected shape \[32, 64\]"),
    (_set("midlayer.self_attn.o_proj.weight", torch.zeros(H, 16)), r"o_proj\.weight: expected shape \[32, 32\]"),
    (_set("lm_head.weight", torch.zeros(DRAFT_VOCAB + 1, H)), r"lm_head\.weight: expected shape \[20, 32\]"),
    (_set("d2t", torch.zeros(DRAFT_VOCAB + 3, dtype=torch.int64)),
     r"d2t: expected integer shape \[20\] \(draft_vocab_size\), found torch.int64 \[23\]"),
    (_set("d2t", torch.full((DRAFT_VOCAB,), VOCAB, dtype=torch.int64)), r"d2t: draft id 0 maps to target id 50"),
    (_set("d2t", torch.full((DRAFT_VOCAB,), -1, dtype=torch.int64)), r"d2t: draft id 0 maps to target id -1"),
    (_set("d2t", torch.tensor([1] + [0] * (DRAFT_VOCAB - 1))), r"d2t: two draft ids map to the same target id"),
    (_del("d2t"), r"d2t: missing, but draft_vocab_size 20 != vocab_size 50"),
    (_set("embed_tokens.weight", torch.zeros(VOCAB - 1, H)), r"embed_tokens\.weight: expected shape \[50, 32\]"),
    (_set("midlayer.extra.weight", torch.zeros(3)), r"unexpected tensors \['midlayer\.extra\.weight'\]"),
])
def test_bad_tensor_is_named(tmp_path: Path, edit: Callable[[dict], None], match: str) -> None:
    root = _saved(tmp_path)
    _edit_tensors(root, edit)
    with pytest.raises(ValueError, match=match):
        load_eagle3_checkpoint(root)


def test_fc_shape_checked_against_declared_target_hidden_size(tmp_path: Path) -> None:
    root = _saved(tmp_path)
    _edit_tensors(root, _set("fc.weight", torch.zeros(H, 3 * H + 3)))
    with pytest.raises(ValueError, match=r"fc\.weight: expected shape \[32, 96\] = \[H, 3\*H_t\], found \[32, 99\]"):
        load_eagle3_checkpoint(root)


def test_fc_not_divisible_by_three_without_declared_target_hidden_size(tmp_path: Path) -> None:
    root = _saved(tmp_path, "speculators")  # target_hidden_size null: inferred from fc.weight
    _edit_tensors(root, _set("fc.weight", torch.zeros(H, 100)))
    with pytest.raises(ValueError, match=r"fc\.weight: expected shape \[hidden_size, 3\*target_hidden_size\]"):
        load_eagle3_checkpoint(root)


def test_target_sizes_must_match(tmp_path: Path) -> None:
    root = _saved(tmp_path, "speculators")
    with pytest.raises(ValueError, match=r"target_hidden_size: the head expects 32 .*fc\.weight.* target has 64"):
        load_eagle3_checkpoint(root, target_hidden_size=64)
    with pytest.raises(ValueError, match=r"vocab_size: checkpoint has 50, target vocab is 64"):
        load_eagle3_checkpoint(root, target_vocab_size=64)


def test_missing_config_json(tmp_path: Path) -> None:
    root = _saved(tmp_path)
    (root / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json not found"):
        load_eagle3_checkpoint(root)


def test_missing_required_config_field(tmp_path: Path) -> None:
    root = _saved(tmp_path)
    _edit_config(root, lambda c: c.pop("intermediate_size"))
    with pytest.raises(ValueError, match="config field intermediate_size missing"):
        load_eagle3_checkpoint(root)


def test_corrupt_safetensors_names_the_file(tmp_path: Path) -> None:
    root = _saved(tmp_path)
    (root / "model.safetensors").write_bytes(b"\x00not a safetensors file" * 4)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        load_eagle3_checkpoint(root)


def test_pickle_only_directory_is_refused_with_a_conversion_hint(tmp_path: Path) -> None:
    root = _saved(tmp_path)
    (root / "model.safetensors").unlink()
    torch.save({"fc.weight": torch.zeros(2, 2)}, root / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle checkpoints") as info:
        load_eagle3_checkpoint(root)
    assert "weights_only=True" in str(info.value) and "save_file" in str(info.value)


# ---------------------------------------------------------------- unsupported variants


def test_two_layer_speculators_head_is_refused(tmp_path: Path) -> None:
    root = _saved(tmp_path, "speculators")
    _edit_config(root, lambda c: c["transformer_layer_config"].update(num_hidden_layers=2))
    _edit_tensors(root, lambda t: t.update({k.replace("layers.0.", "layers.1."): v.clone()
                                            for k, v in list(t.items()) if k.startswith("layers.0.")}))
    with pytest.raises(NotImplementedError, match=r"head has 2 decoder layers"):
        load_eagle3_checkpoint(root)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(norm_before_fc=True), r"norm_before_fc=True"),
    (lambda c: c.update(fc_norm=True), r"fc_norm=True"),
    (lambda c: c.update(norm_output=True), r"norm_output=True"),
    (lambda c: c["transformer_layer_config"].update(layer_types=["sliding_attention"]), r"layer_types"),
    (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), r"model_type='qwen3'"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 3, 4]), r"eagle_aux_hidden_state_layer_ids"),
])
def test_speculators_variant_flags_are_refused(tmp_path: Path, edit: Callable[[dict], None], match: str) -> None:
    root = _saved(tmp_path, "speculators")
    _edit_config(root, edit)
    with pytest.raises(NotImplementedError, match=match):
        load_eagle3_checkpoint(root)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c["eagle_config"].update(use_aux_hidden_state=False), r"eagle_config\.use_aux_hidden_state=false"),
    (lambda c: c.update(mlp_bias=True), r"config field mlp_bias=True"),
    (lambda c: c.update(num_aux_hidden_states=4), r"num_aux_hidden_states: 4 captured target layers"),
])
def test_eagle_variant_flags_are_refused(tmp_path: Path, edit: Callable[[dict], None], match: str) -> None:
    root = _saved(tmp_path)
    _edit_config(root, edit)
    with pytest.raises(NotImplementedError, match=match):
        load_eagle3_checkpoint(root)


def test_norm_before_fc_under_eagle_config_and_input_norm_tensor_are_refused(tmp_path: Path) -> None:
    root = _saved(tmp_path)
    _edit_config(root, lambda c: c["eagle_config"].update(norm_before_fc=True))  # NVIDIA ModelOpt placement
    with pytest.raises(NotImplementedError, match=r"eagle_config\.norm_before_fc"):
        load_eagle3_checkpoint(root)
    _edit_config(root, lambda c: c["eagle_config"].pop("norm_before_fc"))
    _edit_tensors(root, _set("input_norm.weight", torch.ones(3 * H)))
    with pytest.raises(ValueError, match=r"unexpected tensors \['input_norm\.weight'\]"):
        load_eagle3_checkpoint(root)
