"""Tiny random models for the tests: built from configs, saved, loaded through the real loaders."""
from __future__ import annotations

import shutil
import tempfile
from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tllm_spec import Eagle3Config
from tllm_spec.drafts.eagle3.checkpoint import save_eagle3_checkpoint
from tllm_spec.tools.random_models import random_head_for, save_random_target, target_config

_ROOT = Path(tempfile.mkdtemp(prefix="tllm_spec_tests_"))
ARCH_DIALECT = {"llama": "eagle", "qwen2": "speculators", "qwen3": "angelslim", "mistral": "eagle",
                "qwen3_moe": "angelslim", "glm4_moe": "eagle", "mixtral": "speculators"}
MOE_FAMILIES = ("qwen3_moe", "glm4_moe", "mixtral")
ARCH_OVERRIDES = {
    "mistral": {"sliding_window": 7}, "qwen2": {}, "qwen3": {"head_dim": 32}, "llama": {},
    # mixture of experts: 8 (Mixtral 4) experts of intermediate 32, two per token
    "qwen3_moe": dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]),
    "glm4_moe": dict(head_dim=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                     routed_scaling_factor=1.5, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=None),
}


@cache
def tiny_pair(arch: str = "llama", vocab_size: int = 97, draft_vocab_size: int | None = None, seed: int = 0,
              head_scale: float = 1.0, num_layers: int = 8) -> tuple[Path, Path]:
    """(target_dir, head_dir) of a tiny random ``arch`` target and a random EAGLE-3 head in its dialect.

    ``head_scale`` multiplies the head's matrices: > 1 makes its attention sharp enough that a wrong
    position or a stale cache entry changes the drafts.
    """
    cfg = target_config(arch, vocab_size=vocab_size, num_hidden_layers=num_layers, **ARCH_OVERRIDES[arch])
    root = _ROOT / f"{arch}-{vocab_size}-{draft_vocab_size}-{seed}-{head_scale}-{num_layers}"
    target = save_random_target(root / "target", cfg, seed=seed)
    ckpt = random_head_for(cfg, draft_vocab_size=draft_vocab_size, seed=seed + 1)
    for name, tensor in ckpt.state_dict.items():
        if tensor.dim() == 2 and tensor.is_floating_point():
            tensor.mul_(head_scale)
    save_eagle3_checkpoint(root / "head", ckpt, ARCH_DIALECT[arch])
    return target, root / "head"


def char_tokenizer(eos: str = "<eos>"):
    """A byte-level tokenizer with one token per printable ASCII character (ids 0-94), newline (95) and EOS (96):
    97 tokens, the tiny targets' vocabulary, so grammar-constrained output decodes to text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = printable[:], 0
    for b in range(256):  # GPT-2's bytes_to_unicode: bytes outside `printable` map to 256, 257, ...
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    byte_chars = {b: chr(c) for b, c in zip(printable, codes)}
    vocab = {byte_chars[b]: i for i, b in enumerate(list(range(32, 127)) + [10])}
    vocab[eos] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos)


@cache
def tiny_guided_pair(draft_vocab_size: int | None = None) -> tuple[Path, Path]:
    """tiny_pair("llama") with char_tokenizer() saved in the target directory (EOS = 96)."""
    target, head = tiny_pair("llama", draft_vocab_size=draft_vocab_size)
    root = _ROOT / f"guided-{draft_vocab_size}"
    shutil.copytree(target, root / "target", dirs_exist_ok=True)
    char_tokenizer().save_pretrained(root / "target")
    return root / "target", head


def eagle3(head: Path, k: int) -> Eagle3Config:
    return Eagle3Config(speculative_model=str(head), max_draft_len=k)


@cache
def hf_model(target: Path):
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def hf_greedy(target: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy continuation (HF generate), exactly max_new_tokens long."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model(target).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                        min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@cache
def tiny_draft_lm(arch: str = "llama", vocab_size: int = 97, seed: int = 7, num_layers: int = 2,
                  hidden_size: int = 32) -> Path:
    """A small random causal LM of ``arch`` with the tiny targets' vocabulary: a draft LM (DraftTargetConfig)."""
    cfg = target_config(arch, vocab_size=vocab_size, num_hidden_layers=num_layers, hidden_size=hidden_size,
                        intermediate_size=2 * hidden_size, num_attention_heads=2, num_key_value_heads=1)
    return save_random_target(_ROOT / f"draft-{arch}-{vocab_size}-{seed}-{num_layers}-{hidden_size}", cfg, seed=seed)


def assert_greedy_lossless(target: Path, model, prompts: list[list[int]], max_new: list[int]):
    """Generate greedily and check each output against the target's own greedy continuation; the outputs."""
    from tllm_spec import SamplingParams

    outs = model.generate(prompts, [SamplingParams(max_new_tokens=n) for n in max_new])
    for prompt, n, out in zip(prompts, max_new, outs):
        assert out.token_ids == hf_greedy(target, prompt, n), f"prompt {prompt}"
    return outs


def family_grid(ks: tuple[int, ...], fast: set[tuple[str, int]]) -> list:
    """pytest params (arch, k) over the four fused families and ``ks``: the ``fast`` pairs in the README's test
    command, the rest of the grid marked slow."""
    import pytest

    return [pytest.param(a, k, marks=[] if (a, k) in fast else [pytest.mark.slow])
            for a in ("llama", "qwen2", "qwen3", "mistral") for k in ks]
