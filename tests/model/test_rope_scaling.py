"""RoPE scaling (Llama-3.1's llama3, Qwen's YaRN): speculative greedy output stays equal to HF greedy past
``original_max_position_embeddings``, and an EAGLE-3 head saved with the same scaling rotates as the target.

Tiny targets with original_max_position_embeddings = 32 and rope_theta = 100 (so the scaling changes most
frequencies), prompts of 41-57 tokens and 40 new tokens: every step runs at positions 41-97.
"""
from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
import torch

from tllm_spec import MTPConfig, SamplingParams
from tllm_spec.drafts.eagle3.checkpoint import save_eagle3_checkpoint
from tllm_spec.drafts.mtp.model import save_random_mtp_weights
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.random_models import random_head_for, save_random_target, target_config

from ..models import ARCH_OVERRIDES, eagle3, hf_greedy, hf_model

ORIGINAL_MAX, THETA, MAX_NEW = 32, 100.0, 40
SCALING = {  # arch -> (rope_scaling, max_position_embeddings, head dialect)
    "llama": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL_MAX}, 512, "eagle"),  # legacy rope_scaling fields
    "qwen3": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX}, 128,
              "speculators"),  # transformer_layer_config.rope_parameters
}
_g = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(0, 97, (n,), generator=_g).tolist() for n in (41, 57)]


@functools.cache
def scaled_pair(arch: str) -> tuple[Path, Path]:
    """(target_dir, head_dir): a random ``arch`` target with SCALING[arch] (and 2 MTP modules in its
    checkpoint), and a random EAGLE-3 head whose config carries the same rope scaling."""
    scaling, max_positions, dialect = SCALING[arch]
    cfg = target_config(arch, rope_scaling=scaling, rope_theta=THETA, max_position_embeddings=max_positions,
                        **ARCH_OVERRIDES[arch])
    root = Path(tempfile.mkdtemp(prefix=f"tllm_spec_rope_{arch}_"))
    target = save_random_target(root / "target", cfg, seed=0)
    save_random_mtp_weights(target, 2, "deepseek", seed=2)
    save_eagle3_checkpoint(root / "head", random_head_for(cfg, seed=1), dialect)
    config_file = root / "head" / "config.json"
    config = json.loads(config_file.read_text())
    layer = config.get("transformer_layer_config") or config
    layer["max_position_embeddings"] = max_positions
    if dialect == "speculators":
        layer["rope_parameters"] = {**scaling, "rope_theta": THETA}
    else:
        layer.update(rope_theta=THETA, rope_scaling=scaling)
    config_file.write_text(json.dumps(config))
    return target, root / "head"


def unscaled_inv_freq(head_dim: int) -> torch.Tensor:
    return 1.0 / THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


@pytest.mark.parametrize("arch", list(SCALING))
def test_oracle_is_scaled_and_the_scaling_changes_greedy_output(arch):
    """The test cannot pass vacuously: HF's rotary is scaled, and dropping the scaling changes HF greedy."""
    target, _ = scaled_pair(arch)
    rotary = hf_model(target).model.rotary_emb
    assert rotary.rope_type == SCALING[arch][0]["rope_type"]
    plain = unscaled_inv_freq(2 * rotary.inv_freq.numel())
    assert (rotary.inv_freq - plain).abs().max() > 0.1
    assert (rotary.attention_scaling > 1.0) == (arch == "qwen3")  # YaRN's 0.1·ln(4) + 1
    scaled = [hf_greedy(target, p, MAX_NEW) for p in PROMPTS]
    saved = rotary.inv_freq.clone(), rotary.attention_scaling
    try:
        rotary.inv_freq.copy_(plain)
        rotary.attention_scaling = 1.0
        assert [hf_greedy(target, p, MAX_NEW) for p in PROMPTS] != scaled
    finally:
        rotary.inv_freq.copy_(saved[0])
        rotary.attention_scaling = saved[1]


@pytest.mark.parametrize("arch", list(SCALING))
def test_target_and_draft_rotary_tables_equal_hf(arch):
    """The fused target's table, the EAGLE-3 head's table and HF's rotary agree, positions 0..max past 32
    (breaks if from_hf recomputed inv_freq from rope_theta, dropped attention_scaling, or the head's
    loader ignored rope_scaling / rope_parameters)."""
    target, head = scaled_pair(arch)
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2)
    table, draft = model.target.fused.rotary, model.worker.draft_model
    hf_rotary = hf_model(target).model.rotary_emb
    torch.testing.assert_close(table.inv_freq, hf_rotary.inv_freq, rtol=0, atol=0)
    assert table.attention_scaling == hf_rotary.attention_scaling
    assert draft.rotary_emb.rope_type == hf_rotary.rope_type
    torch.testing.assert_close(draft.rope_table.inv_freq, table.inv_freq, rtol=0, atol=0)
    assert draft.rope_table.attention_scaling == table.attention_scaling
    assert draft.rope_table.max_positions == table.max_positions >= len(PROMPTS[1]) + MAX_NEW
    assert torch.equal(draft.rope_table.cos, table.cos) and torch.equal(draft.rope_table.sin, table.sin)
    positions = torch.arange(table.max_positions)
    cos, sin = hf_rotary(torch.zeros(1, 1, dtype=torch.float32), positions[None])
    torch.testing.assert_close(table.cos, cos[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(table.sin, sin[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("arch", list(SCALING))
def test_eagle3_greedy_lossless_past_original_max(arch, fused):
    """Breaks if the target's positions were capped or wrapped at original_max_position_embeddings, or its
    RoPE table lost the scaling (fused: tllm_spec's table; stock: the HF module fed the engine's positions)."""
    target, head = scaled_pair(arch)
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2, use_fused_layers=fused)
    assert (model.target.fused is not None) == fused
    outs = model.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(target, prompt, MAX_NEW), f"prompt of {len(prompt)} tokens"
    assert outs.stats["steps"] > 0


@pytest.mark.parametrize("arch", list(SCALING))
@pytest.mark.parametrize("mtp", [MTPConfig(num_nextn_predict_layers=2, use_mtp_vanilla=True),
                                 MTPConfig(num_nextn_predict_layers=1, max_draft_len=3)], ids=["vanilla", "eagle"])
def test_mtp_greedy_lossless_past_original_max(arch, mtp):
    """MTP modules share the target's rotary embedding (and its table once fused): same output as HF greedy
    (breaks if that table capped positions at original_max_position_embeddings or lost the scaling)."""
    target, _ = scaled_pair(arch)
    model = SpecModel.from_pretrained(target, mtp, max_batch_size=2)
    draft = model.worker.draft_model
    assert draft.rotary_emb is model.target.decoder.rotary_emb
    torch.testing.assert_close(draft.rope_table.inv_freq, model.target.fused.rotary.inv_freq, rtol=0, atol=0)
    assert draft.rope_table.attention_scaling == model.target.fused.rotary.attention_scaling
    outs = model.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))
    assert [out.token_ids for out in outs] == [hf_greedy(target, p, MAX_NEW) for p in PROMPTS]
