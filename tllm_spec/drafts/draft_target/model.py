"""Loading a draft LM: a local Hugging Face causal LM of the target's vocabulary, its KV layers after the target's."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ...model.decoder import FusedDecoder
from ...model.target import TargetModel
from ...tokenizer import load_tokenizer

FUSED_FAMILIES = "Llama, Qwen2, Qwen3, Mistral"


def load_draft_lm(path: str | Path, target: TargetModel, dtype: torch.dtype, device: torch.device) -> TargetModel:
    """The draft LM at ``path`` as a :class:`TargetModel` whose K/V go to the cache layers after the target's.

    Refused in one line each: a directory that is not a causal LM, an architecture the fused layers do not run,
    a vocabulary (embedding rows or tokenizer) that differs from the target's."""
    path = Path(path)
    _check_causal_lm(path)
    draft = TargetModel.load(path, dtype, device)
    if not FusedDecoder.supports(draft.hf):
        raise ValueError(f"{path}: a draft LM runs on the fused layers, which do not support "
                         f"{type(draft.hf).__name__} (supported: {FUSED_FAMILIES})")
    check_same_vocabulary(path, draft.vocab_size, target)
    draft.place_kv_layers(target.num_layers)
    return draft


def _check_causal_lm(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a Hugging Face model directory (no config.json); a draft LM is a "
                                "causal LM's directory")
    config = AutoConfig.from_pretrained(path)
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise ValueError(f"{path}: not a causal LM ({type(config).__name__}, model_type "
                         f"{config.model_type!r}); the draft must be a causal LM of the target's vocabulary")
    architectures = getattr(config, "architectures", None) or []
    if any("Eagle" in name for name in architectures):
        raise ValueError(f"{path}: an EAGLE head ({', '.join(architectures)}), not a draft LM; use Eagle3Config")


def check_same_vocabulary(path: Path, draft_vocab_size: int, target: TargetModel) -> None:
    """The draft predicts the target's token ids: the same number of logits, and where both directories ship a
    tokenizer, the same token -> id map."""
    if draft_vocab_size != target.vocab_size:
        raise ValueError(f"{path}: the draft LM's vocabulary has {draft_vocab_size} tokens, the target's "
                         f"{target.vocab_size}; a draft LM must share the target's tokenizer and vocabulary")
    if target.checkpoint_dir is None:
        return
    draft_tok, target_tok = load_tokenizer(path), load_tokenizer(target.checkpoint_dir)
    if draft_tok is not None and target_tok is not None and draft_tok.get_vocab() != target_tok.get_vocab():
        raise ValueError(f"{path}: the draft LM's tokenizer ({len(draft_tok)} tokens) is not the target's "
                         f"({len(target_tok)} tokens); a draft LM must share the target's tokenizer")
