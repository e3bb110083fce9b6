"""The paged, cached draft passes equal a cache-free EAGLE-3 reference recomputed from scratch each step."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tllm_spec import SamplingParams
from tllm_spec.drafts.eagle3.checkpoint import load_eagle3_checkpoint
from tllm_spec.sampling.sampler import greedy_draft_tokens
from tllm_spec.spec_model import SpecModel

from ..models import eagle3, hf_model, tiny_pair


def reference_layer(dm, w, token_ids, hidden):
    """EAGLE-3 midlayer over a whole sequence with plain causal attention, from the checkpoint's own tensors
    ``w`` (split q/k/v and gate/up, whatever the engine fused). [S], [S, H] -> pre-norm [S, H]."""
    mid = dm.midlayer
    normed = mid.hidden_norm(hidden)
    x = torch.cat([mid.input_layernorm(dm.embed_tokens(token_ids)), normed], -1)
    seq, cfg = len(token_ids), dm.head.llama_config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    q, k, v = (F.linear(x, w[f"midlayer.self_attn.{p}_proj.weight"]).view(seq, n, -1).transpose(0, 1)
               for p, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)))
    cos, sin = dm.rotary_emb(hidden, torch.arange(seq)[None])
    q, k = apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=0)
    rep = heads // kv_heads
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), is_causal=True)
    h = hidden + F.linear(o.transpose(0, 1).flatten(1), w["midlayer.self_attn.o_proj.weight"])
    m = mid.post_attention_layernorm(h)
    gate, up, down = (w[f"midlayer.mlp.{p}_proj.weight"] for p in ("gate", "up", "down"))
    return h + F.linear(F.silu(F.linear(m, gate)) * F.linear(m, up), down)


def reference_drafts(model, target, head, committed, k):
    """Drafts after ``committed`` tokens (the last one has no target KV yet), recomputed without any cache."""
    dm, layers = model.worker.draft_model, model.target._capture_ids
    w = load_eagle3_checkpoint(head).state_dict
    with torch.no_grad():
        hs = hf_model(target)(torch.tensor([committed[:-1]]), output_hidden_states=True).hidden_states
        hidden = dm.fc(torch.cat([hs[i + 1][0] for i in layers], -1))  # output of layer i = hidden_states[i+1]
        tokens = torch.tensor(committed[1:])
        drafts = []
        for _ in range(k):
            pre = reference_layer(dm, w, tokens, hidden)
            drafts.append(greedy_draft_tokens(dm.compute_logits(pre[-1:]), dm.vocab_offsets).item())
            tokens = torch.cat([tokens, torch.tensor([drafts[-1]])])
            hidden = torch.cat([hidden, pre[-1:]])
    return drafts


def check_drafts_against_reference(target, head, k=3):
    """Every step's proposals equal the cache-free reference over the committed tokens."""
    prompts = [[5, 17, 3, 44, 9, 2, 71], [12, 8, 40]]
    model = SpecModel.from_pretrained(target, eagle3(head, k), max_batch_size=2)
    proposals = []  # (slot, drafts) per request per step
    original = model.worker.draft

    def recording_draft(*args):
        drafts = original(*args)
        proposals.append(drafts.tolist())
        return drafts

    model.worker.draft = recording_draft
    outs = model.generate(prompts, SamplingParams(max_new_tokens=8))
    checked = 0
    # after step s, request b has committed prompt + output[:accepted so far]
    for b, (prompt, out) in enumerate(zip(prompts, outs)):
        committed_lens = [1] + [n for n in out.stats.accepted_per_step]
        total = 0
        for step, n in enumerate(committed_lens):
            total += n
            if total > len(out.token_ids) - 1:
                break  # the request finished in this step; later rows belong to others
            assert proposals[step][b] == reference_drafts(model, target, head, prompt + out.token_ids[:total], k), step
            checked += 1
    assert checked >= 10
    return model


@pytest.mark.parametrize("draft_vocab_size", [None, 40])
def test_cached_drafts_equal_cache_free_reference(draft_vocab_size):
    target, head = tiny_pair("llama", draft_vocab_size=draft_vocab_size, head_scale=12.0)
    check_drafts_against_reference(target, head)


def test_six_layer_target_feeds_the_repeated_default_layer_twice():
    # default capture (1, L//2-1, L-4) on 6 layers = (1, 2, 2): fc reads layer 2's output twice
    target, head = tiny_pair("llama", head_scale=12.0, num_layers=6)
    model = check_drafts_against_reference(target, head)
    assert model.target._capture_ids == (1, 2, 2)
    seen, original = [], model.worker.draft
    model.worker.draft = lambda ids, rows, features, *rest: seen.append(features) or original(ids, rows, features,
                                                                                               *rest)
    model.generate([[5, 17, 3, 44]], SamplingParams(max_new_tokens=2))
    features = seen[0]  # the target features the head's first pass read
    hidden = model.target.hidden_size
    assert features.shape[-1] == 3 * hidden
    assert torch.equal(features[:, hidden:2 * hidden], features[:, 2 * hidden:])
    assert not torch.equal(features[:, :hidden], features[:, hidden:2 * hidden])
