"""Top-1 agreement of a quantized target with its 16-bit original: over held-out text, teacher-forced, the share of
positions where both models' most likely next token is the same (the issue's quality measure for FP8, beside the
acceptance evaluation). ``scripts/eval_acceptance.py --agreement`` writes it into the evaluation's JSON."""
from __future__ import annotations

import torch

from ..demo import ASSETS
from ..tokenizer import load_tokenizer
from .acceptance_eval import heldout_texts, prompt_ids


@torch.inference_mode()
def top1_agreement(reference: torch.nn.Module, quantized: torch.nn.Module, sequences: list[list[int]]) -> dict:
    """``reference`` and ``quantized``: HF causal LMs (``TargetModel.hf``) on one device; each sequence runs as one
    teacher-forced forward. Returns {"positions", "agreement" (0-1), "mean_abs_logprob_diff" of the reference's
    top token}."""
    agree = total = 0
    diffs = []
    for ids in sequences:
        x = torch.tensor([ids], device=next(reference.parameters()).device)
        a = reference(x).logits[0].float().log_softmax(-1)
        b = quantized(x).logits[0].float().log_softmax(-1)
        top = a.argmax(-1)
        agree += int((top == b.argmax(-1)).sum())
        total += len(ids)
        diffs.append((a.gather(-1, top[:, None]) - b.gather(-1, top[:, None])).abs().flatten())
    return {"positions": total, "agreement": agree / max(total, 1),
            "mean_abs_logprob_diff": float(torch.cat(diffs).mean()) if diffs else 0.0}


def heldout_sequences(n: int, tokens: int = 256, tokenizer=None) -> list[list[int]]:
    """The first ``tokens`` token ids of the first ``n`` held-out files that have that many."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(ASSETS / "target")
    return prompt_ids(tokenizer, heldout_texts(), n, tokens)


def quantized_agreement(target: str, quantization: str, device: str = "cpu", dtype: str | None = None,
                        num_texts: int = 32, tokens: int = 256) -> dict:
    """:func:`top1_agreement` of ``target`` (a directory or ``demo://target``) loaded with ``quantization`` against
    the same checkpoint loaded without it, over ``num_texts`` held-out texts of ``tokens`` tokens."""
    from .. import demo
    from ..engine.loader import resolve_device, resolve_dtype
    from ..model.target import TargetModel

    path = demo.resolve(target)
    device_ = resolve_device(device)
    dtype_ = resolve_dtype(dtype, device_)
    reference = TargetModel.load(path, dtype_, device_).hf
    quantized = TargetModel.load(path, dtype_, device_, quantization=quantization).hf
    for model in (reference, quantized):  # whole-sequence forwards: the stock attention, not the paged one
        model.set_attn_implementation("sdpa")
    result = top1_agreement(reference, quantized, heldout_sequences(num_texts, tokens, load_tokenizer(path)))
    return {"quantization": quantization, "num_texts": num_texts, "tokens": tokens, **result}
