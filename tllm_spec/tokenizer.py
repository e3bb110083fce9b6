"""Tokenizer loading from a target directory (optional: token-id prompts need none)."""
from __future__ import annotations

import warnings
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase | None:
    """The directory's tokenizer, or None when it ships none (a warning if one is present but unreadable)."""
    path = Path(path)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as err:  # a broken tokenizer must not block token-id decoding
        warnings.warn(f"{path}: tokenizer files present but not loadable ({err}); use token-id prompts")
        return None
