"""Bad input: each gives a clear error, and a bad request harms no other request."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from tllm_spec import Eagle3Config, SamplingParams
from tllm_spec.model.target import max_positions
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.random_models import save_random_head, save_random_target, target_config

from ..models import eagle3, hf_greedy, tiny_pair

GOOD = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [33, 34, 35, 36]]


@pytest.fixture
def head_copy(tmp_path):
    """A private copy of the tiny llama head (tiny_pair's directories are shared across tests)."""
    _, head = tiny_pair("llama")
    return shutil.copytree(head, tmp_path / "head")


def assert_good_outputs(target, outs, indices, max_new):
    for i in indices:
        assert outs[i].finish_reason == "length" and outs[i].error is None
        assert outs[i].token_ids == hf_greedy(target, outs[i].prompt_token_ids, max_new)


# ---- per-request validation inside generate -------------------------------------------------------------------

def test_bad_prompts_rejected_good_ones_exact():
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2, max_seq_len=16)
    free = (model.runner.kv_cache.num_free_pages, model.runner.kv_cache.num_free_slots)
    too_long = list(range(1, 14))  # 13 + K + 1 = 17 > max_seq_len 16
    just_fits = list(range(1, 13))  # 12 + K + 1 = 16: accepted, stops at max_seq_len after 4 tokens
    prompts = [GOOD[0], too_long, [], GOOD[1], [4, 97, 5], [4, -1, 5], GOOD[2], just_fits]
    with pytest.warns(UserWarning, match="rejected") as caught:
        outs = model.generate(prompts, SamplingParams(max_new_tokens=8))
    assert sorted(str(w.message).split(":")[0] for w in caught if "rejected" in str(w.message)) == [
        f"request {i} rejected" for i in (1, 2, 4, 5)]
    assert [o.index for o in outs] == list(range(len(prompts)))
    assert [o.prompt_token_ids for o in outs] == prompts
    rejected = {1: ["13", "17", "max_seq_len", "16"], 2: ["empty"], 4: ["[0, 97)", "97"], 5: ["[0, 97)", "-1"]}
    for i, words in rejected.items():
        assert outs[i].finish_reason == "rejected" and outs[i].token_ids == []
        for word in words:
            assert word in outs[i].error, (i, outs[i].error)
    assert_good_outputs(target, outs, [0, 3, 6], 8)
    assert outs[7].finish_reason == "length" and outs[7].token_ids == hf_greedy(target, just_fits, 4)
    assert (model.runner.kv_cache.num_free_pages, model.runner.kv_cache.num_free_slots) == free


def test_non_integer_token_id_rejected_alone():
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2)
    with pytest.warns(UserWarning, match="request 1 rejected"):
        outs = model.generate([GOOD[0], [4, 1.5, 5]], SamplingParams(max_new_tokens=8))
    assert outs[1].finish_reason == "rejected" and "integer" in outs[1].error
    assert_good_outputs(target, outs, [0], 8)


def test_reservation_larger_than_the_pool_is_rejected():
    target, head = tiny_pair("llama")
    # 2 real pages of 16 = 32 tokens; reservation = prompt + max_new + 2K + 1
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2, num_pages=3)
    big = SamplingParams(max_new_tokens=40)  # 2 + 40 + 7 = 49 tokens -> 4 pages
    small = SamplingParams(max_new_tokens=8)  # <= 7 + 8 + 7 = 22 tokens -> 2 pages
    with pytest.warns(UserWarning, match="request 1 rejected"):
        outs = model.generate([GOOD[0], GOOD[1], GOOD[2]], [small, big, small])
    assert outs[1].finish_reason == "rejected" and outs[1].token_ids == []
    assert "needs 4 KV pages" in outs[1].error and "pool has 2" in outs[1].error
    assert_good_outputs(target, outs, [0, 2], 8)
    assert model.runner.kv_cache.num_free_pages == 2


@pytest.mark.parametrize("field,value", [("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
                                         ("max_new_tokens", 0)])
def test_invalid_sampling_params(field, value):
    with pytest.raises(ValidationError) as err:
        SamplingParams(**{field: value})
    assert [e["loc"] for e in err.value.errors()] == [(field,)]


@pytest.fixture(scope="module")
def plain_model():
    target, _ = tiny_pair("llama")
    return SpecModel.from_pretrained(target, None, max_batch_size=2)


@pytest.mark.parametrize("prompts", ["hello", [1, 2, 3]], ids=["string", "flat-ids"])
def test_generate_refuses_unbatched_prompts(plain_model, prompts):
    with pytest.raises(TypeError, match="list of strings or of token-id lists"):
        plain_model.generate(prompts)


def test_generate_refuses_flat_tensor(plain_model):
    with pytest.raises(TypeError, match="list of strings or of token-id lists"):
        plain_model.generate(torch.tensor([1, 2, 3]))


def test_generate_refuses_mismatched_sampling_params(plain_model):
    with pytest.raises(ValueError, match="3 SamplingParams for 2 prompts"):
        plain_model.generate(GOOD[:2], [SamplingParams()] * 3)


def test_string_prompt_without_tokenizer_is_refused_alone(plain_model):
    assert plain_model.tokenizer is None
    with pytest.warns(UserWarning, match="request 1 rejected: a string prompt needs a tokenizer"):
        good, refused = plain_model.generate([GOOD[0], "some text"], SamplingParams(max_new_tokens=4))
    assert refused.finish_reason == "rejected" and "tokenizer" in refused.error
    assert good.finish_reason == "length" and len(good.token_ids) == 4


# ---- loading: draft / target mismatch and broken head directories ---------------------------------------------

def test_head_for_another_hidden_size(tmp_path):
    target, _ = tiny_pair("llama")
    head = save_random_head(tmp_path / "head", target_config("llama", hidden_size=32, num_attention_heads=4,
                                                             num_key_value_heads=2))
    with pytest.raises(ValueError, match="target_hidden_size") as err:
        SpecModel.from_pretrained(target, eagle3(head, 3))
    assert "32" in str(err.value) and "64" in str(err.value)


def test_head_for_another_vocab(tmp_path):
    target, _ = tiny_pair("llama")
    head = save_random_head(tmp_path / "head", target_config("llama", vocab_size=101))
    with pytest.raises(ValueError, match="vocab_size") as err:
        SpecModel.from_pretrained(target, eagle3(head, 3))
    assert "101" in str(err.value) and "97" in str(err.value)


def test_unsupported_variant_flag(head_copy):
    target, _ = tiny_pair("llama")
    config = json.loads((head_copy / "config.json").read_text())
    (head_copy / "config.json").write_text(json.dumps({**config, "norm_before_fc": True}))
    with pytest.raises(NotImplementedError, match="norm_before_fc"):
        SpecModel.from_pretrained(target, eagle3(head_copy, 3))


def test_pickle_only_head_asks_for_safetensors(head_copy):
    target, _ = tiny_pair("llama")
    torch.save(load_file(str(head_copy / "model.safetensors")), head_copy / "pytorch_model.bin")
    (head_copy / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors") as err:
        SpecModel.from_pretrained(target, eagle3(head_copy, 3))
    assert "safetensors.torch.save_file" in str(err.value)  # the conversion recipe


def test_truncated_safetensors_names_the_file(head_copy):
    target, _ = tiny_pair("llama")
    file = head_copy / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file") as err:
        SpecModel.from_pretrained(target, eagle3(head_copy, 3))
    assert str(file) in str(err.value)


def test_head_without_config(head_copy):
    target, _ = tiny_pair("llama")
    (head_copy / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json not found"):
        SpecModel.from_pretrained(target, eagle3(head_copy, 3))


def test_missing_target_dir(tmp_path):
    _, head = tiny_pair("llama")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        SpecModel.from_pretrained(tmp_path / "nowhere", eagle3(head, 3))


def test_capture_layer_beyond_the_target():
    target, head = tiny_pair("llama")  # 8 decoder layers
    spec = Eagle3Config(speculative_model=str(head), max_draft_len=3, eagle3_layers_to_capture=(1, 2, 50))
    with pytest.raises(ValueError, match="eagle3_layers_to_capture") as err:
        SpecModel.from_pretrained(target, spec)
    assert "50" in str(err.value) and "8 layers" in str(err.value)


def test_default_capture_layers_need_six_target_layers():
    from tllm_spec.drafts.eagle3.model import resolve_capture_layers

    assert resolve_capture_layers(None, None, 6) == (1, 2, 2)
    with pytest.raises(ValueError, match="5 decoder layers is too shallow"):
        resolve_capture_layers(None, None, 5)
    assert resolve_capture_layers((3, 0, 3), None, 5) == (0, 3, 3)  # an explicit choice still works


# ---- loading: a target checkpoint that is not the whole model, a max_seq_len past the target's positions ------------

def test_a_target_checkpoint_missing_a_weight_is_refused(tmp_path):
    target, _ = tiny_pair("llama")
    shutil.copytree(target, tmp_path / "target")
    weights = tmp_path / "target" / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="randomly initialised") as err:
        SpecModel.from_pretrained(tmp_path / "target", None)
    assert "lacks 1 of" in str(err.value) and "model.layers.3.mlp.up_proj.weight" in str(err.value)


def test_an_eagle3_head_is_not_a_target():
    _, head = tiny_pair("llama")
    with pytest.raises(ValueError, match="EAGLE-3 head") as err:
        SpecModel.from_pretrained(head, None)
    message = str(err.value)
    assert "lacks 10 of" in message and "model.embed_tokens.weight" in message and "and 7 more" in message


@pytest.mark.parametrize("rope_scaling, max_seq_len", [
    (None, 64), ({"rope_type": "linear", "factor": 4.0}, 256),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 128),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16}, 64)])  # llama3's config states the stretched length itself
def test_max_seq_len_up_to_the_targets_positions(rope_scaling, max_seq_len, tmp_path):
    config = target_config("llama", max_position_embeddings=64, rope_scaling=rope_scaling, num_hidden_layers=1)
    assert max_positions(config) == max_seq_len
    target = save_random_target(tmp_path / "target", config)
    model = SpecModel.from_pretrained(target, None, max_batch_size=1, max_seq_len=max_seq_len)
    assert model.engine.max_seq_len == max_seq_len
    with pytest.raises(ValueError, match=f"max_seq_len={max_seq_len + 1} is more than the {max_seq_len} positions"):
        SpecModel.from_pretrained(target, None, max_batch_size=1, max_seq_len=max_seq_len + 1)


def test_max_positions_of_a_config_per_layer_type():
    config = target_config("llama", max_position_embeddings=64)
    config.rope_parameters = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert max_positions(config) == 128
