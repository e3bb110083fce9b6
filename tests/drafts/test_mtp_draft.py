"""The paged, windowed MTP draft passes equal a cache-free reference recomputed from scratch every step.

Reference (DeepSeek-V3 chain): committed tokens s_0..s_L, target hiddens h_0..h_{L-1}. Module k (0-based)
runs over positions 0..L-1 with token x[i+k+1] (x = s followed by the drafts so far) and the hidden handed
on by module k-1 at the same position; its draft comes from position L-1. MTP-Eagle runs module 0
EAGLE-style: each new draft extends the sequence by one position whose hidden is the fed-back output.
Attention is SDPA on a copy of each block, so neither our attention nor our cache takes part; the blocks are
the stock HF layers of a second, unfused load of the same checkpoint, so neither do our fused layers.
"""
import copy
import functools
import tempfile
from pathlib import Path

import pytest
import torch

from tllm_spec import MTPConfig, SamplingParams
from tllm_spec.drafts.mtp.model import save_random_mtp_weights
from tllm_spec.model.layers import DecoderLayer
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.random_models import save_random_target, target_config

from ..models import hf_greedy, hf_model

PROMPTS = [[1, 2, 3, 4, 0, 2, 5, 1], [3, 1], [5, 4, 3, 2, 1, 0, 1, 2, 3, 4, 5, 0, 2]]


@functools.cache
def sharp_target(arch: str, vocab_size: int, scale: float) -> Path:
    """A tiny target (small vocabulary, so drafts are sometimes right) with 3 sharp MTP modules."""
    root = Path(tempfile.mkdtemp(prefix="tllm_spec_mtp_ref_"))
    save_random_target(root, target_config(arch, vocab_size=vocab_size), seed=1)
    save_random_mtp_weights(root, 3, "deepseek", seed=2, scale=scale)
    return root


def stock_model(target: Path, cfg: MTPConfig) -> SpecModel:
    """The same checkpoint loaded with the stock HF modules (no fused layers): the reference's weights."""
    return SpecModel.from_pretrained(target, cfg, max_batch_size=1, use_fused_layers=False)


def reference_module(draft_model, k: int, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Module k over a whole sequence (positions 0..S-1) with SDPA causal attention. -> pre-norm [S, H]."""
    module = draft_model.mtp_modules[k]
    block = copy.deepcopy(module.block)
    block.self_attn.config = copy.deepcopy(block.self_attn.config)
    block.self_attn.config._attn_implementation = "sdpa"
    x = module.eh_proj(torch.cat([module.enorm(draft_model.embed_tokens(tokens)), module.hnorm(hidden)], -1))
    positions = torch.arange(len(tokens))[None]
    out = block(x[None], attention_mask=None, position_ids=positions,
                position_embeddings=draft_model.rotary_emb(x[None], positions))
    return (out[0] if isinstance(out, tuple) else out)[0]


def propose(draft_model, k: int, pre: torch.Tensor) -> int:
    return int(draft_model.compute_logits(k, pre[-1:]).argmax(-1))


def reference_drafts(model, target: Path, committed: list[int], vanilla: bool) -> list[int]:
    """Drafts after ``committed`` (its last token has no target hidden yet), recomputed without any cache."""
    dm, k_max = model.worker.draft_model, model.max_draft_len
    with torch.no_grad():
        hidden = hf_model(target).model(torch.tensor([committed[:-1]])).last_hidden_state[0]
        num_pos, seq, drafts = len(committed) - 1, list(committed), []
        tokens = torch.tensor(committed[1:])
        for k in range(k_max):
            if vanilla:  # module k: token x[i+k+1], hidden handed on by module k-1 at position i
                pre = reference_module(dm, k, torch.tensor(seq[k + 1:k + 1 + num_pos]), hidden)
                drafts.append(propose(dm, k, pre))
                hidden = dm.feedback(k, pre)
            else:  # module 0 reused; the new position's hidden is the fed-back output of the last one
                pre = reference_module(dm, 0, tokens, hidden)
                drafts.append(propose(dm, 0, pre))
                tokens = torch.cat([tokens, torch.tensor(drafts[-1:])])
                hidden = torch.cat([hidden, dm.feedback(0, pre[-1:])])
            seq.append(drafts[-1])
    return drafts


def run_recorded(model, prompts, max_new, oracle_refs=None):
    """Generate, recording the module drafts of every step. With ``oracle_refs`` (slot -> prompt + target
    continuation) the worker hands the engine the target's own continuation instead, so every draft is
    accepted (K+1 tokens a step) while the modules still run and are recorded."""
    recorded, original = [], model.worker.draft

    def recording_draft(input_ids, row_tokens, features, num_accepted, attn, md):
        drafts = original(input_ids, row_tokens, features, num_accepted, attn, md)
        last = md.gather_ids[md.first_rows() + num_accepted - 1]
        slots, positions = attn.token_slots[last].tolist(), attn.positions[last].tolist()
        recorded.append(dict(zip(slots, drafts.tolist())))  # all requests start together: slot b = request b
        if oracle_refs is None:
            return drafts
        rows = [oracle_refs[slot][pos + 2:pos + 2 + model.max_draft_len] for slot, pos in zip(slots, positions)]
        return torch.tensor(rows, dtype=torch.int64)

    model.worker.draft = recording_draft
    return model.generate(prompts, SamplingParams(max_new_tokens=max_new)), recorded


def check_against_reference(stock, target, prompts, outs, recorded, vanilla):
    checked, lengths = 0, set()
    for b, (prompt, out) in enumerate(zip(prompts, outs)):
        total = 0
        for step, n in enumerate([1] + out.stats.accepted_per_step):
            total += n
            if total > len(out.token_ids) - 1:
                break  # the request finished in this step
            assert recorded[step][b] == reference_drafts(stock, target, prompt + out.token_ids[:total], vanilla), \
                (b, step)
            checked += 1
            lengths.add(n)
    return checked, lengths


@pytest.mark.parametrize("vanilla", [True, False], ids=["vanilla3", "eagle3"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_drafts_equal_cache_free_reference(arch, vanilla):
    target = sharp_target(arch, 6, 4.0)
    cfg = MTPConfig(num_nextn_predict_layers=3, use_mtp_vanilla=True) if vanilla else MTPConfig(max_draft_len=3)
    model = SpecModel.from_pretrained(target, cfg, max_batch_size=3)
    outs, recorded = run_recorded(model, PROMPTS, 12)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(target, prompt, 12)
    checked, lengths = check_against_reference(stock_model(target, cfg), target, PROMPTS, outs, recorded, vanilla)
    assert checked >= 15 and len(lengths) >= 2, (checked, lengths)  # some drafts accepted, some rejected


@pytest.mark.parametrize("feedback", ["pre_norm", "post_norm"])
def test_full_acceptance_windows_equal_reference(feedback):
    """Every step accepts all K drafts: the vanilla window slides by K+1 (the case TensorRT-LLM's fixed
    N-row window leaves a gap at), and the next drafts still match the reference."""
    target = sharp_target("llama", 6, 4.0)
    cfg = MTPConfig(num_nextn_predict_layers=3, use_mtp_vanilla=True, mtp_hidden_feedback=feedback)
    model = SpecModel.from_pretrained(target, cfg, max_batch_size=3)
    refs = {i: p + hf_greedy(target, p, 30) for i, p in enumerate(PROMPTS)}
    outs, recorded = run_recorded(model, PROMPTS, 13, oracle_refs=refs)
    assert all(set(o.stats.accepted_per_step) == {4} for o in outs)
    checked, _ = check_against_reference(stock_model(target, cfg), target, PROMPTS, outs, recorded, vanilla=True)
    assert checked >= 9


@pytest.mark.parametrize("vanilla", [True, False], ids=["vanilla2", "eagle3"])
@pytest.mark.parametrize("arch,overrides", [("qwen3", {"head_dim": 32}), ("mistral", {"sliding_window": 5})],
                         ids=["qwen3", "mistral"])
def test_fused_mtp_blocks_draft_as_the_stock_blocks(arch, overrides, vanilla):
    """Qwen3 (q/k norms) and Mistral (a sliding window the prompts cross): the fused MTP blocks propose,
    step by step, the drafts of the stock HF blocks loaded from the same checkpoint."""
    root = Path(tempfile.mkdtemp(prefix=f"tllm_spec_mtp_{arch}_"))
    save_random_target(root, target_config(arch, vocab_size=8, **overrides), seed=1)
    save_random_mtp_weights(root, 2, "deepseek", seed=2, scale=4.0)
    cfg = MTPConfig(num_nextn_predict_layers=2, use_mtp_vanilla=True) if vanilla else MTPConfig(max_draft_len=3)
    prompts = [PROMPTS[0] + [3, 4, 5, 2, 1, 0], PROMPTS[1], PROMPTS[2]]
    runs = []
    for fused in (True, False):
        model = SpecModel.from_pretrained(root, cfg, max_batch_size=3, use_fused_layers=fused)
        assert fused == all(isinstance(m.block, DecoderLayer) for m in model.worker.draft_model.mtp_modules)
        outs, recorded = run_recorded(model, prompts, 14)
        runs.append(([o.token_ids for o in outs], recorded))
    assert runs[0] == runs[1] and len(runs[0][1]) >= 5
    assert all(out == hf_greedy(root, p, 14) for out, p in zip(runs[0][0], prompts))
