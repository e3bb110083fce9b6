"""A byte-level BPE tokenizer trained with the ``tokenizers`` library, saved so transformers 4.x and 5.x load it."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from transformers import PreTrainedTokenizerFast

BOS, EOS = "<|bos|>", "<|eos|>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 pre-tokenization, every byte in the base alphabet) with ``<|bos|>`` = 0 and
    ``<|eos|>`` = 1; encoding adds no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: str | Path, model_max_length: int) -> None:
    """tokenizer.json + a tokenizer_config.json naming ``PreTrainedTokenizerFast`` (transformers 5 would write
    ``TokenizersBackend``, which transformers 4 cannot load)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.backend_tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "model_max_length": model_max_length, "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
