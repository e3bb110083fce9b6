"""GlobalPool: the texts of finished requests, matched by every running request (``SAConfig.enable_global_pool``).

The pool is ``size`` tokens on the device, each finished text followed by a separator (-1, never a token), written
from the start again once the next text does not fit (the oldest texts go first). Per request slot it keeps the
match array of its own text's suffix against the pool, ``match[s, j]`` = the longest common suffix of the pool up
to j and the request's text: the recurrence of :mod:`.suffix_match` with the pool on one side, so it grows in the
step's graph as the request accepts tokens. Adding a text (a request finished: the host knows it, between steps)
rebuilds every slot's array against the new pool from the last ``initial_cap`` tokens of its text.
"""
from __future__ import annotations

import torch
from torch import nn

from .suffix_match import SuffixMatch

SEPARATOR = -1


def pool_match_update(pool: torch.Tensor, new_tokens: torch.Tensor, num_new: torch.Tensor, old: torch.Tensor
                      ) -> torch.Tensor:
    """The match arrays after each request appended ``num_new[b]`` of ``new_tokens[b]``.

    pool [P] int64 (separators -1); new_tokens [B, W] int64; num_new [B] int64 in 0..W; old [B, P] int32.
    Returns new [B, P] int32: ``old[j - n] + n`` where the n new tokens match the pool backwards from j, else how
    many do (a row with num_new 0 comes back unchanged)."""
    width, size = new_tokens.shape[1], pool.shape[0]
    j = torch.arange(size, device=pool.device)
    n = num_new[:, None]  # [B, 1]
    run = torch.ones(old.shape, dtype=torch.bool, device=pool.device)
    matched = torch.zeros_like(old)
    for m in range(width):
        u = new_tokens.gather(1, (n - 1 - m).clamp(min=0))  # [B, 1] the m-th new token from the end
        run = run & (pool[(j - m).clamp(min=0)] == u) & (j >= m) & (m < n)
        matched = matched + run.to(old.dtype)
    shifted = old.gather(1, (j - n).clamp(min=0)) * (j >= n)
    return torch.where(matched == n, shifted + n.to(old.dtype), matched).to(old.dtype)


class GlobalPool(nn.Module):
    """Finished texts (pool [P] int64) and each slot's match array against them (match [S, P] int32)."""

    def __init__(self, num_slots: int, size: int, min_match: int, initial_cap: int = 64):
        super().__init__()
        self.min_match, self.initial_cap, self.write = min_match, initial_cap, 0
        self.register_buffer("pool", torch.full((size,), SEPARATOR, dtype=torch.int64), persistent=False)
        self.register_buffer("match", torch.zeros(num_slots, size, dtype=torch.int32), persistent=False)

    def add(self, text: list[int], texts: SuffixMatch) -> None:
        """Append a finished request's text (its last size - 1 tokens at most) and a separator; then rebuild every
        slot's array from its own text (``texts``). Eager, between steps."""
        size = self.pool.shape[0]
        text = text[-(size - 1):]
        if self.write + len(text) + 1 > size:  # the oldest texts go: start again from position 0
            self.pool[self.write:] = SEPARATOR
            self.write = 0
        values = torch.tensor([*text, SEPARATOR], dtype=torch.int64).to(self.pool.device, non_blocking=True)
        self.pool[self.write:self.write + len(values)] = values
        self.write += len(values)
        self.rebuild(torch.arange(self.match.shape[0], device=self.pool.device), texts)

    def rebuild(self, slots: torch.Tensor, texts: SuffixMatch) -> None:
        """These slots' arrays from scratch: the last ``initial_cap`` tokens of each one's text as the new ones."""
        cap = min(self.initial_cap, texts.max_len)
        length = texts.length[slots]  # [B]
        count = length.clamp(max=cap)  # [B] tokens matched backwards
        columns = ((length - count)[:, None] + torch.arange(cap, device=slots.device)).clamp(max=texts.max_len - 1)
        suffix = texts.tokens[slots].gather(1, columns)  # [B, cap]: the text's last ``count`` tokens first
        fresh = torch.zeros(len(slots), self.pool.shape[0], dtype=self.match.dtype, device=slots.device)
        self.match[slots] = pool_match_update(self.pool, suffix, count, fresh)

    def extend(self, slots: torch.Tensor, new_tokens: torch.Tensor, num_new: torch.Tensor) -> None:
        """slots [B]; new_tokens [B, W]; num_new [B] in 0..W. Graph-safe."""
        self.match[slots] = pool_match_update(self.pool, new_tokens, num_new, self.match[slots])

    def propose(self, slots: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts [B, k] int64, match_len [B] int64): the pool's tokens after the longest match (ties: the highest
        position), 0 where none reaches ``min_match``; a separator in the continuation becomes token 0."""
        size = self.pool.shape[0]
        match = self.match[slots]  # [B, P]
        j = torch.arange(size, device=slots.device)
        candidate = match >= self.min_match
        best_score, best = torch.where(candidate, match.to(torch.int64) * size + j, -1).max(dim=1)
        found = best_score >= 0
        match_len = torch.where(found, match.gather(1, best[:, None]).squeeze(1).to(torch.int64), 0)
        positions = (best[:, None] + 1 + torch.arange(k, device=slots.device)).clamp(max=size - 1)
        return self.pool[positions].clamp(min=0), match_len
