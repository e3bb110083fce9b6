"""The demo's draft LM: training against a frozen target at a tiny shape, the saved directory, the scores, the
held-out split, and the shipped demo/draft."""
import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from tllm_spec.demo import ASSETS, resolve
from tllm_spec.tokenizer import load_tokenizer
from tllm_spec.tools.demo_draft_lm import (
    TINY_DRAFT_LM,
    chain_agreement,
    forward_costs,
    kl_loss,
    projected_embedding,
    record,
    save_draft_lm,
    split_corpus,
    text_agreement,
    train_draft_lm,
)
from tllm_spec.training.data import read_documents, tokenize_documents

from ..training.helpers import corpus, tiny_target

SHAPE = dataclasses.replace(TINY_DRAFT_LM, max_steps=30, warmup_steps=3, lr=1e-2)


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(tiny_target(), dtype=torch.float32)


@pytest.fixture(scope="module")
def stream():
    tokenizer = load_tokenizer(tiny_target())
    return tokenize_documents(tokenizer, read_documents(sorted(corpus().glob("*.py"))), tokenizer.eos_token_id)


@pytest.mark.parametrize("objective", ["kl", "rollouts"])
def test_training_brings_the_draft_closer_to_the_target(target, stream, objective):
    shape = dataclasses.replace(SHAPE, objective=objective)
    rollouts = stream[:8 * shape.seq_len].reshape(8, shape.seq_len) if objective == "rollouts" else None
    untrained, _ = train_draft_lm(target, stream, dataclasses.replace(shape, max_steps=1, lr=1e-9), torch.device("cpu"),
                                  None, rollouts, progress=False)
    before = text_agreement(untrained, target, stream, 4, shape.seq_len, 2)
    draft, summary = train_draft_lm(target, stream, shape, torch.device("cpu"), None, rollouts, progress=False)
    after = text_agreement(draft, target, stream, 4, shape.seq_len, 2)
    assert summary["steps"] == 30 and summary["objective"] == objective
    assert after["kl"] < before["kl"] - 0.1, (before, after)


def test_the_rollouts_objective_needs_rollouts(target, stream):
    with pytest.raises(ValueError, match="rollouts"):
        train_draft_lm(target, stream, dataclasses.replace(SHAPE, objective="rollouts"), torch.device("cpu"), None)


def test_the_saved_draft_is_a_complete_hf_model_of_the_targets_vocabulary(target, stream, tmp_path):
    draft, _ = train_draft_lm(target, stream, dataclasses.replace(SHAPE, max_steps=2), torch.device("cpu"), None,
                              progress=False)
    save_draft_lm(draft, tiny_target(), tmp_path / "draft")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "draft")
    assert loaded.config.vocab_size == target.config.vocab_size and loaded.config.tie_word_embeddings
    assert (loaded.config.bos_token_id, loaded.config.eos_token_id) == (target.config.bos_token_id,
                                                                       target.config.eos_token_id)
    assert (tmp_path / "draft" / "tokenizer.json").read_bytes() == (tiny_target() / "tokenizer.json").read_bytes()
    assert load_tokenizer(tmp_path / "draft").encode("def f(x):") == load_tokenizer(tiny_target()).encode("def f(x):")
    with safe_open(str(tmp_path / "draft" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.bfloat16}  # noqa: SIM118 (no __iter__)


def test_the_projected_embedding_keeps_the_targets_dot_products_best(target):
    embedding = target.get_input_embeddings().weight.detach()
    gram = embedding @ embedding.T
    full = projected_embedding(target, embedding.shape[1])
    torch.testing.assert_close(full @ full.T, gram, atol=1e-2, rtol=1e-3)
    # rank 8: the Gram matrix's best rank-8 approximation (Eckart-Young), its error the dropped eigenvalues'
    narrow = projected_embedding(target, 8)
    dropped = torch.linalg.svdvals(embedding)[8:]
    assert narrow.shape == (embedding.shape[0], 8)
    assert torch.linalg.matrix_norm(narrow @ narrow.T - gram).item() == pytest.approx(dropped.pow(4).sum().sqrt().item(),
                                                                                    rel=1e-3)
    wide = projected_embedding(target, embedding.shape[1] + 3)
    assert torch.equal(wide[:, :-3], embedding) and not wide[:, -3:].any()


def test_a_draft_identical_to_the_target_agrees_everywhere_and_accepts_every_draft(target, stream):
    prompts = [stream[:8].tolist(), stream[100:108].tolist()]
    chain = chain_agreement(target, target, prompts, new_tokens=8, k=3)
    assert chain["agreement"] == 1.0 and chain["mean_accepted_length_k3"] == 4.0  # 8 tokens in 2 steps of 3 + 1
    assert text_agreement(target, target, stream, 2, 32, 1)["agreement"] == 1.0
    assert kl_loss(torch.zeros(1, 2, 5), torch.zeros(1, 2, 5)).item() == 0.0


def test_forward_costs_time_both_models_at_one_and_four_tokens(target):
    costs = forward_costs(target, target, rounds=1, repeats=2)
    assert set(costs) == {"draft_1tok_ms", "draft_4tok_ms", "target_1tok_ms", "target_4tok_ms", "ratio_1tok"}
    assert all(value > 0 for value in costs.values())


def test_the_split_holds_out_the_listed_files_and_every_tenth(tmp_path):
    files = [tmp_path / f"m{i:02d}.py" for i in range(20)]
    for f in files:
        f.write_text("x = 1\n")
    (tmp_path / "heldout.json").write_text(json.dumps({"files": ["m00.py", "m03.py"]}))
    train, heldout = split_corpus(files, tmp_path / "heldout.json")
    assert [f.name for f in heldout] == ["m00.py", "m03.py"]
    assert not {f.name for f in train} & {"m00.py", "m03.py", "m09.py", "m19.py"} and len(train) == 16


def test_record_adds_the_phase_and_keeps_the_rest(tmp_path):
    (tmp_path / "recipe.json").write_text(json.dumps({"target": {"steps": 1}, "draft_lm": {"old": True}}))
    record(tmp_path / "recipe.json", {"steps": 7})
    assert json.loads((tmp_path / "recipe.json").read_text()) == {"target": {"steps": 1}, "draft_lm": {"steps": 7}}


@pytest.mark.skipif(not (ASSETS / "draft" / "config.json").is_file(), reason="no shipped demo/draft")
def test_the_shipped_draft_loads_with_the_targets_vocabulary_and_tokenizer():
    draft_dir, target_dir = resolve("demo://draft"), resolve("demo://target")
    draft = AutoModelForCausalLM.from_pretrained(draft_dir)
    target_config = AutoConfig.from_pretrained(target_dir)
    assert draft.config.vocab_size == target_config.vocab_size == 4096
    assert (draft.config.bos_token_id, draft.config.eos_token_id) == (target_config.bos_token_id,
                                                                     target_config.eos_token_id)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (draft_dir / name).read_bytes() == (target_dir / name).read_bytes()
    assert sum(p.stat().st_size for p in draft_dir.iterdir()) < 3_000_000
    recorded = json.loads((ASSETS / "recipe.json").read_text())["draft_lm"]
    assert recorded["shape"]["model"]["num_hidden_layers"] == draft.config.num_hidden_layers
    ids = torch.tensor([load_tokenizer(draft_dir).encode("def main():\n    return")])
    assert draft(input_ids=ids).logits.shape == (1, ids.shape[1], 4096)
