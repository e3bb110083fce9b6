"""The "before" of the benchmark: HF generate on the same weights, stock modules (for a mixture-of-experts target
its experts through a named transformers implementation, the stock loop over experts among them)."""
from __future__ import annotations

import time

import torch

from ..spec_model import SpecModel
from .routing import moe_layers


def hf_generate_tokens_per_second(model: SpecModel, batch: int, prompt_len: int, new_tokens: int,
                                  static_cache: bool, experts_implementation: str | None = None) -> float:
    """HF generate on the same weights (the stock modules, SDPA attention), decode rate from two lengths (prefill
    cancels). ``experts_implementation``: a mixture-of-experts target's experts through this transformers
    implementation ("eager": the stock loop over experts; None: transformers' own choice)."""
    hf = model.target.hf
    saved = hf.get_experts_implementation()
    hf.set_attn_implementation("sdpa")
    if experts_implementation is not None:
        hf.set_experts_implementation(experts_implementation)
    try:
        ids = torch.randint(0, model.target.vocab_size, (batch, prompt_len), device=model.device)
        kwargs = {"do_sample": False, "attention_mask": torch.ones_like(ids), "pad_token_id": 0}
        if static_cache:
            kwargs["cache_implementation"] = "static"

        def timed(n: int) -> float:
            _synchronize(model.device)
            start = time.perf_counter()
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
            _synchronize(model.device)
            return time.perf_counter() - start

        timed(new_tokens)  # warm-up (and compilation for the static cache)
        short, full = timed(2), timed(new_tokens)
        return batch * (new_tokens - 2) / (full - short)
    finally:
        hf.set_attn_implementation("tllm_spec")
        hf.set_experts_implementation(saved)


def hf_generate_row(model: SpecModel, batch: int, prompt_len: int, new_tokens: int, static_cache: bool,
                    experts_implementation: str | None = None) -> dict:
    """:func:`hf_generate_tokens_per_second` as a JSON row saying what ran (``path``; ``experts_implementation``:
    transformers' for a mixture-of-experts target, None for a dense one)."""
    moe = bool(moe_layers(model.target))
    experts = (experts_implementation or model.target.hf.config._experts_implementation) if moe else None
    tps = hf_generate_tokens_per_second(model, batch, prompt_len, new_tokens, static_cache, experts)
    path = f"HF generate: stock modules, sdpa attention, {'static' if static_cache else 'dynamic'} cache"
    if experts is not None:
        path += f", experts_implementation={experts}" + (" (the stock loop over experts)" if experts == "eager" else "")
    return {"batch": batch, "static_cache": static_cache, "experts_implementation": experts, "path": path,
            "tokens_per_second": tps}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
