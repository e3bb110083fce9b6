"""Shared fixtures of the training tests: a synthetic Python-like corpus, a tiny random target with a BPE tokenizer,
and short draft-training runs on it (each built once per session)."""
from __future__ import annotations

import random
import tempfile
from functools import cache
from pathlib import Path

from safetensors.torch import load_file, save_file

from tllm_spec.tools.random_models import save_random_target, target_config
from tllm_spec.training import DraftTrainConfig, train_draft
from tllm_spec.training.data import read_documents
from tllm_spec.training.tokenizer import save_tokenizer, train_bpe_tokenizer

ROOT = Path(tempfile.mkdtemp(prefix="tllm_spec_training_tests_"))
VOCAB = 300
NAMES = ["alpha", "beta", "gamma", "delta", "value", "items", "count", "total"]


@cache
def corpus(num_files: int = 12) -> Path:
    """``num_files`` small, regular Python files (deterministic)."""
    rng, root = random.Random(0), ROOT / f"corpus{num_files}"
    root.mkdir(parents=True)
    for i in range(num_files):
        lines = []
        for f in range(25):
            a, b = rng.sample(NAMES, 2)
            lines += [f"def {a}_{f}({b}, n={rng.randint(0, 9)}):", "    total = 0", "    for i in range(n):",
                      f"        total += {b}[i] * {rng.randint(1, 9)}", "    return total", ""]
        (root / f"mod_{i:02d}.py").write_text("\n".join(lines))
    return root


@cache
def tiny_target() -> Path:
    """A random 8-layer Llama (hidden 64) with a byte-level BPE tokenizer trained on :func:`corpus`. Its lm_head
    is scaled up so that its next-token distributions are peaked (a nearly uniform teacher leaves a draft little
    to learn beyond the entropy floor)."""
    target = ROOT / "target"
    tokenizer = train_bpe_tokenizer(read_documents(sorted(corpus().glob("*.py"))), VOCAB)
    config = target_config("llama", vocab_size=VOCAB, eos_token_id=tokenizer.eos_token_id,
                           bos_token_id=tokenizer.bos_token_id)
    save_random_target(target, config, seed=0)
    weights = load_file(str(target / "model.safetensors"))
    weights["lm_head.weight"] *= 6.0
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(tokenizer, target, 512)
    return target


def train_config(kind: str, name: str, **overrides) -> DraftTrainConfig:
    fields = dict(target=str(tiny_target()), data=(str(corpus()),), kind=kind, out=str(ROOT / name), steps=40,
                  batch_size=4, seq_len=48, lr=3e-3, warmup_steps=4, progress=False, save_every=0)
    return DraftTrainConfig(**{**fields, **overrides})


@cache
def trained(kind: str):
    """A 40-step run: EAGLE-3 with a 96-token draft vocabulary, or one MTP-Eagle module (3 levels)."""
    extra = {"draft_vocab": 96} if kind == "eagle3" else {}
    return train_draft(train_config(kind, f"run-{kind}", **extra))
