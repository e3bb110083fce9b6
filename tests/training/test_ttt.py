"""Training-time test: the TTT mask, and the unrolled training forward == the inference draft passes through the
paged KV cache (EAGLE-3 head and MTP-Eagle module), chain by chain, level by level."""
import pytest
import torch
from transformers import AutoConfig

from tllm_spec.drafts.eagle3.checkpoint import load_eagle3_checkpoint
from tllm_spec.drafts.eagle3.model import Eagle3DraftModel
from tllm_spec.drafts.mtp.checkpoint import MTPCheckpoint
from tllm_spec.drafts.mtp.model import MTPDraftModel
from tllm_spec.model.attention import AttentionMetadata
from tllm_spec.model.kv_cache import KVCache
from tllm_spec.model.target import TargetModel
from tllm_spec.tools.random_models import TINY
from tllm_spec.training.eagle3 import Eagle3Trainer
from tllm_spec.training.mtp import MTPTrainer, init_mtp_modules
from tllm_spec.training.teacher import Teacher
from tllm_spec.training.ttt import ttt_attention_mask
from tllm_spec.training.vocab import build_draft_vocab

from ..models import tiny_pair


def brute_force_mask(seq_len: int, level: int) -> torch.Tensor:
    """Simulate inference for every chain start t: a cache keyed by position, level 0 writes positions <= t,
    level i writes position t + i; the level-`level` query reads every position <= t + level. Map each entry
    back to its (level, row) block of the training layout."""
    mask = torch.zeros(seq_len, (level + 1) * seq_len, dtype=torch.bool)
    for t in range(seq_len):
        cache = {p: (0, p) for p in range(t + 1)}  # position -> (writing level, training row)
        for i in range(1, level + 1):
            cache[t + i] = (i, t)
        for p, (i, row) in cache.items():
            if p <= t + level:
                mask[t, i * seq_len + row] = True
    return mask


@pytest.mark.parametrize("seq_len,level", [(1, 0), (5, 0), (5, 1), (7, 3), (3, 4)])
def test_ttt_mask_equals_brute_force(seq_len, level):
    assert torch.equal(ttt_attention_mask(seq_len, level), brute_force_mask(seq_len, level))


def _cache(shapes, max_tokens):
    kv = KVCache(shapes, num_pages=16, page_size=4, max_requests=1, max_tokens_per_request=max_tokens,
                 dtype=torch.float32, device="cpu")
    return kv, kv.allocate(max_tokens)


def inference_chain(step, ids, first_hidden, t, levels, kv, slot):
    """Run a draft as the workers do: one context pass over positions 0..t (token p+1 with hidden p), then one
    token per level at position t+j fed the previous output and the ground-truth token t+j+1.
    ``step(ids [N], hidden [N, H], attn) -> out [N, H]``; returns the chain's per-level outputs [H]."""
    positions = torch.arange(t + 1)
    attn = AttentionMetadata.build(kv, torch.full((t + 1,), slot), positions, 64, context_lens=(t + 1,))
    out = step(ids[1:t + 2], first_hidden[:t + 1], attn)[t:t + 1]
    outs = [out[0]]
    for j in range(1, levels):
        one = AttentionMetadata.build(kv, torch.tensor([slot]), torch.tensor([t + j]), 64)
        out = step(ids[t + j + 1:t + j + 2], out, one)
        outs.append(out[0])
    return outs


@pytest.mark.parametrize("draft_vocab_size", [None, 40])
def test_eagle3_unroll_equals_inference_passes(draft_vocab_size):
    torch.manual_seed(0)
    _, head_dir = tiny_pair("llama", draft_vocab_size=draft_vocab_size, head_scale=8.0)
    ckpt = load_eagle3_checkpoint(head_dir)
    vocab_size, hidden_size = ckpt.config.llama_config.vocab_size, ckpt.config.llama_config.hidden_size
    draft = Eagle3DraftModel.from_checkpoint(ckpt, 0, torch.nn.Embedding(vocab_size, hidden_size),
                                             torch.float32, torch.device("cpu")).eval()
    vocab = build_draft_vocab(torch.arange(vocab_size), draft_vocab_size or vocab_size)
    trainer = Eagle3Trainer(draft, vocab, ttt_steps=4).eval()
    seq_len = 12
    ids = torch.randint(0, vocab_size, (seq_len,))
    aux = torch.randn(seq_len, 3 * hidden_size)
    with torch.no_grad():
        levels = trainer.unroll(aux[None], ids[None])
        kv, slot = _cache([draft.kv_shape], 32)
        for t in (0, 3, 7):
            chain = inference_chain(draft, ids, aux, t, 4, kv, slot)  # the first pass applies fc to [N, 3H]
            for j, out in enumerate(chain):
                torch.testing.assert_close(levels[j][0, t], out, rtol=1e-4, atol=1e-5, msg=f"chain {t} level {j}")


@pytest.mark.parametrize("feedback", ["pre_norm", "post_norm"])
def test_mtp_eagle_unroll_equals_inference_passes(feedback):
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **TINY, vocab_size=97)
    target = TargetModel.from_config(config, torch.float32, "cpu")
    teacher = Teacher(target.hf)
    modules = init_mtp_modules(teacher, 1, seed=3)
    for p in modules[0].parameters():  # move away from the copied last layer / unit norms
        p.data.add_(0.05 * torch.randn_like(p))
    trainer = MTPTrainer(modules, teacher, ttt_steps=3, hidden_feedback=feedback).eval()
    ckpt = MTPCheckpoint("deepseek", config.num_hidden_layers, trainer.module_states())
    draft = MTPDraftModel.from_checkpoint(ckpt, target, feedback, torch.float32, torch.device("cpu"))
    seq_len = 10
    ids = torch.randint(0, 97, (seq_len,))
    hidden = torch.randn(seq_len, config.hidden_size)
    with torch.no_grad():
        levels = trainer.unroll(hidden[None], ids[None])
        shapes = target.kv_layer_shapes() + draft.kv_shapes()
        kv, slot = _cache(shapes, 32)
        for t in (0, 4, 6):
            def step(i, h, a):  # the context pass reads the target's hidden, later passes the fed-back output
                return draft(0, i, h if a.context_lens else draft.feedback(0, h), a)
            chain = inference_chain(step, ids, hidden, t, 3, kv, slot)
            for j, out in enumerate(chain):
                torch.testing.assert_close(levels[j][0, t], out, rtol=1e-4, atol=1e-5, msg=f"chain {t} level {j}")
