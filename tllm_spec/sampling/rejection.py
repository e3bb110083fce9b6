"""Speculative (rejection) sampling: accept draft x with probability min(1, p(x) / q(x)); on the first
rejection draw from normalize(max(p - q, 0)); after K acceptances draw the bonus from p.

The emitted tokens follow the target distribution p exactly (Leviathan et al. 2023), and at T > 0 more
drafts survive than with strict acceptance (draft == independently sampled target token).
"""
from __future__ import annotations

import torch

from . import flashinfer_ops, rng

_SALT_ACCEPT, _SALT_RESIDUAL = 0xACCE, 0x2E51


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     seed: torch.Tensor, offset: torch.Tensor, use_flashinfer: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [G, K+1, V] f32 (the processed distributions of the K+1 verify rows); draft_probs
    [G, K, V] f32 (the distributions the drafts were sampled from, full vocabulary); draft_tokens [G, K].
    Returns (tokens [G, K+1] int64: accepted drafts then the correction/bonus, rest 0; num_accepted [G]
    int64, the emitted count, bonus included). seed, offset: [1] int64, the batch stream (seed advanced in
    place), or [G] int64 per-request streams (torch path only: pass use_flashinfer=False)."""
    if use_flashinfer and flashinfer_ops.available(target_probs.device):
        tokens = torch.ops.tllm_spec.flashinfer_chain_speculative_sampling(draft_probs, draft_tokens, target_probs,
                                                                           seed, offset)
        rng.advance(seed)
        return tokens.clamp(min=0), (tokens >= 0).sum(-1)
    return rejection_sample_ref(target_probs, draft_probs, draft_tokens, seed, offset)


def rejection_sample_ref(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                         seed: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch path of :func:`rejection_sample` (the CPU path and the oracle): no host syncs."""
    num_gen, k, vocab = draft_probs.shape
    d = draft_tokens.unsqueeze(-1)
    p_of_draft = target_probs[:, :k].gather(-1, d).squeeze(-1)  # [G, K]
    q_of_draft = draft_probs.gather(-1, d).squeeze(-1)
    u = rng.uniform(seed, offset, (num_gen, k), salt=_SALT_ACCEPT)
    accepted = (u * q_of_draft < p_of_draft).to(torch.int64)  # u < p / q, without dividing by q
    num_drafts = accepted.cumprod(-1).sum(-1)  # [G] drafts accepted before the first rejection
    residual = torch.cat([(target_probs[:, :k] - draft_probs).clamp(min=0), target_probs[:, k:]], dim=1)
    rows = residual[torch.arange(num_gen, device=d.device), num_drafts]  # [G, V]
    fallback = target_probs[torch.arange(num_gen, device=d.device), num_drafts]
    rows = torch.where(rows.sum(-1, keepdim=True) > 0, rows, fallback)  # p == q to rounding: draw from p
    noise = -torch.log(rng.uniform(seed, offset, (num_gen, vocab), salt=_SALT_RESIDUAL))
    correction = (rows / noise).argmax(-1)  # exponential race: a draw from rows / rows.sum()
    rng.advance(seed)
    positions = torch.arange(k + 1, device=d.device)
    tokens = torch.cat([draft_tokens, torch.zeros_like(draft_tokens[:, :1])], dim=1)
    tokens = torch.where(positions < num_drafts[:, None], tokens, 0)
    tokens = tokens.scatter(1, num_drafts[:, None], correction[:, None])
    return tokens, num_drafts + 1


def full_vocab_probs(draft_probs: torch.Tensor, d2t: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Map draft-vocabulary probabilities [..., V_draft] to the target vocabulary [..., V] through d2t."""
    if d2t is None:
        return draft_probs
    target_ids = torch.arange(draft_probs.shape[-1], device=draft_probs.device) + d2t
    full = draft_probs.new_zeros(*draft_probs.shape[:-1], vocab_size)
    return full.index_copy_(-1, target_ids, draft_probs)
