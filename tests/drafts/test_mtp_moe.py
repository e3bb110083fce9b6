"""MoE MTP modules (GLM-4.5 / GLM-4.5-Air layout): per-expert checkpoint tensors <-> the block's fused experts,
refusals that name the tensor, an MoE block past the target's dense layers, and a module's logits equal to a
reference assembled without tllm_spec's loader (transformers loads the block from the same checkpoint; the
MTP-only tensors are read raw from the safetensors files).

The tiny GLM target: 2 decoder layers, layer 0 dense (``first_k_dense_replace = 1``), layer 1 MoE with 8 routed
experts in 2 groups (1 kept), 2 per token, one shared expert; MTP module i is ``model.layers.{2 + i}``.
"""
import functools
import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tllm_spec import MTPConfig
from tllm_spec.drafts.mtp.checkpoint import (
    LAYOUTS,
    OWN_KEYS,
    load_mtp_checkpoint,
    save_mtp_weights,
)
from tllm_spec.drafts.mtp.model import random_mtp_modules, save_random_mtp_weights
from tllm_spec.drafts.mtp.worker import build_mtp_worker
from tllm_spec.model.attention import AttentionMetadata
from tllm_spec.model.kv_cache import KVCache
from tllm_spec.model.target import TargetModel
from tllm_spec.tools.random_models import save_random_target, target_config

from ..models import hf_model
from .test_mtp_checkpoint import rewrite_shard

L, E, I = 2, 8, 32  # target layers, routed experts, expert intermediate size
GLM4_MOE = {"hidden_size": 64, "num_hidden_layers": L, "first_k_dense_replace": 1, "n_routed_experts": E,
            "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "moe_intermediate_size": I, "head_dim": 16,
            "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 1}
EXPERTS = f"model.layers.{L}.mlp.experts"


def glm4_moe_config(vocab_size: int = 97):
    return target_config("glm4_moe", vocab_size=vocab_size, **GLM4_MOE)


@functools.cache
def glm_target(num_modules: int = 1) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """(directory, canonical MTP weights) of the tiny GLM target with ``num_modules`` random modules appended."""
    root = Path(tempfile.mkdtemp(prefix="tllm_spec_mtp_glm_"))
    save_random_target(root, glm4_moe_config(), seed=0)
    return root, save_random_mtp_weights(root, num_modules, "deepseek", seed=1, scale=2.0)


def test_block_is_moe_past_the_dense_layers():
    root, states = glm_target(2)
    target = TargetModel.load(root, torch.float32, "cpu")
    assert type(target.decoder.layers[0].mlp).__name__ == "Glm4MoeMLP"  # the dense layer the MTP block is built from
    cfg = MTPConfig(num_nextn_predict_layers=2, use_mtp_vanilla=True)
    modules = build_mtp_worker(target, cfg, max_batch_size=1).draft_model.mtp_modules
    for i, (module, state) in enumerate(zip(modules, states)):
        mlp = module.block.mlp
        assert module.kv_layer == L + i and type(mlp).__name__ == "Glm4MoeMoE"
        assert torch.equal(mlp.experts.gate_up_proj, state["mlp.experts.gate_up_proj"])
        assert torch.equal(mlp.gate.e_score_correction_bias, state["mlp.gate.e_score_correction_bias"])
        assert "mlp.gate.e_score_correction_bias" in dict(module.block.named_buffers())  # loaded as a buffer
        assert mlp.gate.e_score_correction_bias.abs().min() > 0  # random, so routing depends on it


def test_router_stays_fp32_in_a_bf16_load():
    """transformers keeps GLM's router weight and correction bias in fp32 at any dtype; so does the MTP block."""
    root, states = glm_target()
    target = TargetModel.load(root, torch.bfloat16, "cpu")
    mlp = build_mtp_worker(target, MTPConfig(), max_batch_size=1).draft_model.mtp_modules[0].block.mlp
    assert target.decoder.layers[1].mlp.gate.weight.dtype == torch.float32
    assert torch.equal(mlp.gate.weight, states[0]["mlp.gate.weight"])  # as read: fp32, never rounded to bf16
    assert torch.equal(mlp.gate.e_score_correction_bias, states[0]["mlp.gate.e_score_correction_bias"])
    assert mlp.experts.gate_up_proj.dtype == mlp.shared_experts.up_proj.weight.dtype == torch.bfloat16


def shared_own_keys(states):
    """Qwen3-Next stores fc and the three norms once for all modules: make the modules agree on them."""
    return [{**s, **{k: states[0][k] for k in OWN_KEYS}} for s in states]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_expert_checkpoint_round_trips_to_the_fused_form(tmp_path, layout):
    states = shared_own_keys(random_mtp_modules(glm4_moe_config(), 2, seed=3))
    save_mtp_weights(tmp_path, states, layout, num_target_layers=L)
    ckpt = load_mtp_checkpoint(tmp_path, L, 2)
    for want, got in zip(states, ckpt.modules):
        assert want.keys() == got.keys()
        for key in want:  # exact, except the Qwen3-Next (1+w) norms round-trip through w - 1
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6 if layout == "qwen3_next" else 0)


def test_experts_are_written_one_tensor_per_expert(tmp_path):
    """As GLM-4.5's own checkpoints: gate rows first in the fused [E, 2I, H]; the router and its bias too."""
    state = random_mtp_modules(glm4_moe_config(), 1, seed=4)[0]
    save_mtp_weights(tmp_path, [state], "deepseek", num_target_layers=L)
    disk = load_file(tmp_path / "model-mtp.safetensors")
    gate_up, down = state["mlp.experts.gate_up_proj"], state["mlp.experts.down_proj"]
    assert gate_up.shape == (E, 2 * I, 64) and down.shape == (E, 64, I)
    for e in range(E):
        assert torch.equal(disk[f"{EXPERTS}.{e}.gate_proj.weight"], gate_up[e, :I])
        assert torch.equal(disk[f"{EXPERTS}.{e}.up_proj.weight"], gate_up[e, I:])
        assert torch.equal(disk[f"{EXPERTS}.{e}.down_proj.weight"], down[e])
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in disk)
    assert torch.equal(disk[f"model.layers.{L}.mlp.gate.e_score_correction_bias"],
                       state["mlp.gate.e_score_correction_bias"])
    assert disk[f"model.layers.{L}.mlp.shared_experts.down_proj.weight"].shape == (64, I)
    # random weights: fan-in scaled experts (the last dim), a small non-zero correction bias
    torch.testing.assert_close(gate_up.std(), torch.tensor(0.5 / 64 ** 0.5), rtol=0.1, atol=0)
    torch.testing.assert_close(down.std(), torch.tensor(0.5 / I ** 0.5), rtol=0.1, atol=0)
    assert 0 < state["mlp.gate.e_score_correction_bias"].abs().max() < 0.1


rewrite = rewrite_shard  # edit the MTP shard save_mtp_weights wrote, keeping the index in step


def fuse_on_disk(t):
    """Store the experts fused, under the block's own tensor names."""
    gate_up = [torch.stack([t.pop(f"{EXPERTS}.{e}.{p}.weight") for e in range(E)]) for p in ("gate_proj", "up_proj")]
    t[f"{EXPERTS}.gate_up_proj"] = torch.cat(gate_up, dim=1)
    t[f"{EXPERTS}.down_proj"] = torch.stack([t.pop(f"{EXPERTS}.{e}.down_proj.weight") for e in range(E)])


def test_fused_experts_on_disk_are_read_as_is(tmp_path):
    state = random_mtp_modules(glm4_moe_config(), 1, seed=5)[0]
    save_mtp_weights(tmp_path, [state], "deepseek", num_target_layers=L)
    rewrite(tmp_path, fuse_on_disk)
    got = load_mtp_checkpoint(tmp_path, L, 1).modules[0]
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)


def pop_expert(e, *projs):
    return lambda t: [t.pop(f"{EXPERTS}.{e}.{p}.weight") for p in projs]


@pytest.mark.parametrize("edit,match", [
    (pop_expert(3, "up_proj"), rf"{EXPERTS}\.3\.up_proj\.weight: required MTP expert tensor missing"),
    # the last expert entirely absent: the router's 8 rows say it should be there
    (pop_expert(7, "gate_proj", "up_proj", "down_proj"), rf"{EXPERTS}\.7\.gate_proj\.weight: required"),
    (lambda t: t.update({f"{EXPERTS}.8.{p}.weight": t[f"{EXPERTS}.0.{p}.weight"].clone()
                         for p in ("gate_proj", "up_proj", "down_proj")}),
     rf"{EXPERTS}\.8\.down_proj\.weight: expert 8 beyond the router's 8 experts"),
    (lambda t: t.update({f"{EXPERTS}.down_proj": torch.zeros(E, 64, I)}), r"stored both fused and one tensor per"),
])
def test_bad_expert_tensors_are_refused_naming_them(tmp_path, edit, match):
    save_mtp_weights(tmp_path, random_mtp_modules(glm4_moe_config(), 1, seed=6), "deepseek", num_target_layers=L)
    rewrite(tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        load_mtp_checkpoint(tmp_path, L, 1)


def test_missing_router_bias_is_refused_naming_it(tmp_path):
    save_mtp_weights(tmp_path, random_mtp_modules(glm4_moe_config(), 1, seed=6), "deepseek", num_target_layers=L)
    rewrite(tmp_path, lambda t: t.pop(f"model.layers.{L}.mlp.gate.e_score_correction_bias"))
    target = TargetModel.from_config(glm4_moe_config(), torch.float32, "cpu")
    with pytest.raises(ValueError, match=rf"model\.layers\.{L}\.mlp\.gate\.e_score_correction_bias: required"):
        build_mtp_worker(target, MTPConfig(mtp_checkpoint=str(tmp_path)), max_batch_size=1)


def test_mla_target_is_still_refused(tmp_path):
    config = target_config("deepseek_v3", num_hidden_layers=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                           qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=E, first_k_dense_replace=1,
                           moe_intermediate_size=I, n_group=2, topk_group=1, num_experts_per_tok=2)
    target = TargetModel.from_config(config, torch.float32, "cpu")
    save_mtp_weights(tmp_path, random_mtp_modules(glm4_moe_config(), 1), "deepseek", num_target_layers=2)
    with pytest.raises(NotImplementedError, match=r"deepseek_v3: MLA attention \(kv_lora_rank\).*a later issue"):
        build_mtp_worker(target, MTPConfig(mtp_checkpoint=str(tmp_path)), max_batch_size=1)


def test_another_family_with_fused_experts_loads(tmp_path):
    """Nothing is GLM-specific: a Qwen2-MoE block (shared_expert + shared_expert_gate) round-trips and loads."""
    config = target_config("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32)
    state = random_mtp_modules(config, 1, seed=7)[0]
    save_mtp_weights(tmp_path, [state], "deepseek", num_target_layers=config.num_hidden_layers)
    assert f"model.layers.{config.num_hidden_layers}.mlp.experts.3.up_proj.weight" in load_file(
        tmp_path / "model-mtp.safetensors")
    target = TargetModel.from_config(config, torch.float32, "cpu")
    module = build_mtp_worker(target, MTPConfig(mtp_checkpoint=str(tmp_path)), 1).draft_model.mtp_modules[0]
    assert all(torch.equal(v, state[k]) for k, v in module.canonical_state().items())


def raw_mtp_tensors(root: Path) -> dict[str, torch.Tensor]:
    """The module's own (non-block) tensors, read straight from the safetensors files."""
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for key in OWN_KEYS:
        with safe_open(str(root / index[f"model.layers.{L}.{key}"]), framework="pt") as f:
            out[key] = f.get_tensor(f"model.layers.{L}.{key}")
    return out


def reference_logits(root: Path, tokens: torch.Tensor, hidden: torch.Tensor, zero_bias: bool = False
                     ) -> torch.Tensor:
    """GLM's MTP module by hand: eh_proj(cat(enorm(emb(t_{i+1})), hnorm(h_i))) -> the Glm4MoeDecoderLayer that
    transformers itself loads as layer L (per-expert tensors fused by its own converter; causal SDPA) ->
    shared_head.norm -> lm_head. tokens [S] (t_{i+1}), hidden [S, H] (h_i) -> logits [S, V]."""
    ref = AutoModelForCausalLM.from_pretrained(root, num_hidden_layers=L + 1, dtype=torch.float32,
                                               attn_implementation="sdpa").eval()
    raw, eps = raw_mtp_tensors(root), ref.config.rms_norm_eps
    rms = lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    block = ref.model.layers[L]
    assert type(block.mlp).__name__ == "Glm4MoeMoE"
    if zero_bias:
        block.mlp.gate.e_score_correction_bias.zero_()
    x = torch.cat([rms(ref.model.embed_tokens(tokens), raw["enorm.weight"]), rms(hidden, raw["hnorm.weight"])], -1)
    x = (x @ raw["eh_proj.weight"].T)[None]
    positions = torch.arange(len(tokens))[None]
    y = block(x, attention_mask=None, position_ids=positions, position_embeddings=ref.model.rotary_emb(x, positions))
    return ref.lm_head(rms(y[0], raw["shared_head.norm.weight"]))


@pytest.mark.parametrize("fused", [False, True], ids=["stock", "fuse_called"])
@pytest.mark.parametrize("num_tokens", [1, 16])
@torch.no_grad()
def test_module_logits_equal_a_hand_computed_reference(num_tokens, fused):
    """One module pass over a context of ``num_tokens`` tokens (1: a single token) through tllm_spec's paged
    attention equals the reference; ``fuse_called``: after MTPDraftModel.fuse (the fused MoE path once there)."""
    root, _ = glm_target()
    target = TargetModel.load(root, torch.float32, "cpu")
    draft = build_mtp_worker(target, MTPConfig(), max_batch_size=1).draft_model
    if fused:
        draft.fuse(64)
    prompt = torch.tensor([5, 17, 3, 44, 9, 2, 71, 12, 8, 60, 61, 62, 63, 1, 90, 1, 33][:num_tokens + 1])
    hidden = hf_model(root).model(prompt[None, :-1]).last_hidden_state[0]  # h_i: the target's final-normed hidden
    kv = KVCache(target.kv_layer_shapes() + draft.kv_shapes(), num_pages=8, page_size=4, max_requests=1,
                 max_tokens_per_request=16, dtype=torch.float32, device="cpu")
    slot = kv.allocate(16)
    attn = AttentionMetadata.build(kv, torch.full((num_tokens,), slot), torch.arange(num_tokens), 16,
                                   context_lens=(num_tokens,))
    logits = draft.compute_logits(0, draft(0, prompt[1:], hidden, attn))
    want = reference_logits(root, prompt[1:], hidden)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    if num_tokens > 1:  # the check has power: the correction bias changes some token's experts, hence its logits
        assert not torch.allclose(want, reference_logits(root, prompt[1:], hidden, zero_bias=True), atol=1e-4)
