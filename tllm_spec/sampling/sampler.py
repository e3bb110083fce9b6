"""Per-row temperature / top-k / top-p sampling over a batch of logits, greedy rows exact.

Rows are in the flat layout of :class:`tllm_spec.drafts.metadata.SpecMetadata`. Greedy rows carry
``temperature = 1, top_k = 1, top_p = 1`` and get the exact argmax in the same, branch-free call.
The torch path (:func:`sample_ref`) is the CPU path and the oracle of the FlashInfer path.

Per-row random streams (seed/offset of shape [R], for requests with their own seed) need the torch path:
FlashInfer 0.7 reads per-row seed/offset tensors, but seeds its Philox generator with the row's index in
the batch as subsequence, so a request's draws would still depend on where it sits in the batch.
"""
from __future__ import annotations

import torch

from . import flashinfer_ops, rng

MIN_TEMPERATURE = 1e-5  # TensorRT-LLM's "disabled temperature" sentinel; guards a division by zero


def sanitize_top_ks(top_ks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Map disabled top-k (<= 0, or INT32_MAX-style sentinels) to the vocabulary size. [R] int32."""
    return torch.where((top_ks <= 0) | (top_ks > vocab_size), vocab_size, top_ks).to(torch.int32)


def sample(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
           seed: torch.Tensor, offset: torch.Tensor, use_flashinfer: bool = True, salt: int = 0) -> torch.Tensor:
    """Sample one token per row. logits [R, V]; temperatures [R] f32; top_ks [R] int32; top_ps [R] f32;
    seed, offset [1] int64 (the batch stream; seed advanced in place) or [R] int64 (per-row streams: pass
    use_flashinfer=False); salt tells the draws of one step apart (torch path). Returns [R] int64."""
    if use_flashinfer and flashinfer_ops.available(logits.device):
        return sample_flashinfer(logits, temperatures, top_ks, top_ps, seed, offset)
    return sample_ref(logits, temperatures, top_ks, top_ps, seed, offset, salt)


def sample_flashinfer(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                      top_ps: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """FlashInfer path of :func:`sample` (CUDA only)."""
    top_ks = sanitize_top_ks(top_ks, logits.shape[-1])
    scaled = logits.float() / temperatures.clamp(min=MIN_TEMPERATURE).unsqueeze(-1)
    sampled = torch.ops.tllm_spec.flashinfer_top_k_top_p_sample(scaled, top_ks, top_ps, seed, offset)
    rng.advance(seed)
    return torch.where(top_ks == 1, logits.argmax(-1), sampled)


def sample_ref(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
               seed: torch.Tensor, offset: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """Torch path of :func:`sample`: top-k first, then top-p on the renormalised rest, then an
    exponential race (argmax p / E, E ~ Exp(1)) which draws exactly from the kept distribution.

    The noise is indexed by token id, not by rank, so a row's draw depends only on its own stream."""
    num_rows, vocab_size = logits.shape
    top_ks = sanitize_top_ks(top_ks, vocab_size)
    probs, order = filtered_sorted_probs(logits, temperatures, top_ks, top_ps)
    exp_noise = -torch.log(rng.uniform(seed, offset, (num_rows, vocab_size), salt))
    choice = (probs / exp_noise.gather(-1, order)).argmax(-1, keepdim=True)
    sampled = order.gather(-1, choice).squeeze(-1)
    rng.advance(seed)
    return torch.where(top_ks == 1, logits.argmax(-1), sampled)


def filtered_sorted_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                          top_ps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities after temperature, top-k and top-p, in descending order, not renormalised.

    Returns (probs [R, V] f32 sorted descending with filtered entries 0, order [R, V] int64 token ids).
    top_ks must already be sanitised to [1, V].
    """
    scaled = logits.float() / temperatures.clamp(min=MIN_TEMPERATURE).unsqueeze(-1)
    sorted_logits, order = scaled.sort(-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    keep = ranks < top_ks.unsqueeze(-1)
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(-1)
    # the smallest prefix holding >= top_p of the mass
    keep &= torch.ops.tllm_spec.mass_before(probs) < top_ps.unsqueeze(-1)
    return probs * keep, order


@torch.library.custom_op("tllm_spec::mass_before", mutates_args=())
def mass_before(probs: torch.Tensor) -> torch.Tensor:
    """The probability mass before each entry of a row (exclusive cumulative sum over the last axis). [R, V] f32.

    A torch op opaque to torch.compile: Inductor (torch 2.11, CUDA) fails to generate code for the split scan it
    plans over a vocabulary-long row when the row count is dynamic, so the compiled step calls cumsum as is."""
    return probs.cumsum(-1) - probs


@mass_before.register_fake
def _(probs):
    return torch.empty_like(probs)


def target_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                 top_ps: torch.Tensor) -> torch.Tensor:
    """The distribution :func:`sample` draws from, renormalised, in vocabulary order. [R, V] f32."""
    top_ks = sanitize_top_ks(top_ks, logits.shape[-1])
    probs, order = filtered_sorted_probs(logits, temperatures, top_ks, top_ps)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def greedy_draft_tokens(draft_logits: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """Argmax over the draft vocabulary, mapped to target ids: target_id = i + d2t[i].

    draft_logits [N, V_draft]; d2t [V_draft] int64 offsets or None (same vocabulary). Returns [N] int64.
    """
    draft_ids = draft_logits.argmax(-1)
    return draft_ids if d2t is None else draft_ids + d2t[draft_ids]
