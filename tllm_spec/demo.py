"""The embedded default model pair, addressed as ``demo://target``, ``demo://eagle3`` and ``demo://mtp``.

The trained pair ships inside the package (``tllm_spec/assets/demo``, built by
``scripts/build_demo_models.py``: a small Llama target trained on the Python standard library, its EAGLE-3
head and one MTP module with DeepSeek-style keys). Without it (a checkout before the assets were added), the
first use builds a random-weight stand-in with the same layout in ``~/.cache/tllm_spec/demo-random``: a small
Llama target, a byte-level BPE tokenizer trained on the standard library's sources, a random EAGLE-3 head and a
random MTP module. Random weights produce noise text and accept almost no drafts; they only let the pipeline
run with no download.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

PREFIX = "demo://"
ASSETS = Path(__file__).parent / "assets" / "demo"
CACHE = Path(os.path.expanduser("~")) / ".cache" / "tllm_spec" / "demo-random"
VOCAB_SIZE = 1024
_TARGET_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=2048)


def is_trained() -> bool:
    return (ASSETS / "target" / "config.json").is_file()


def resolve(path: str | os.PathLike) -> Path:
    """Map ``demo://NAME`` to a local directory (building the interim pair if needed); other paths unchanged."""
    text = str(path)
    if not text.startswith(PREFIX):
        return Path(path)
    name = text[len(PREFIX):]
    root = ASSETS if is_trained() else _ensure_random_pair()
    if not (root / name).is_dir():
        raise FileNotFoundError(f"{text}: the embedded demo has no {name!r}; it has "
                                f"{sorted(p.name for p in root.iterdir() if p.is_dir())}")
    return root / name


def _ensure_random_pair() -> Path:
    if (CACHE / "eagle3" / "config.json").is_file() and (CACHE / "mtp" / "model.safetensors.index.json").is_file():
        return CACHE
    import shutil

    from .drafts.mtp import random_mtp_modules
    from .drafts.mtp_checkpoint import save_mtp_weights
    from .random_models import save_random_head, save_random_target, target_config

    print(f"tllm_spec: building the interim demo pair (random weights) in {CACHE} ...", flush=True)
    tokenizer = _train_tokenizer()
    config = target_config("llama", vocab_size=VOCAB_SIZE, **_TARGET_SHAPE,
                           eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    save_random_target(CACHE / "target", config)
    tokenizer.save_pretrained(CACHE / "target")
    save_random_head(CACHE / "eagle3", config, dialect="eagle")
    shutil.rmtree(CACHE / "mtp", ignore_errors=True)  # save_mtp_weights appends a shard: start empty
    save_mtp_weights(CACHE / "mtp", random_mtp_modules(config, 1, seed=2), "deepseek",
                     num_target_layers=config.num_hidden_layers)
    return CACHE


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, sorted (a corpus every machine with Python has)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py"))


def _train_tokenizer(files: list[Path] | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(p) for p in (files or stdlib_sources()[:40])], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
