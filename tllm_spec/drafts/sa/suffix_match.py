"""Model-free drafting from a request's own text: TensorRT-LLM's ``SpeculativeDecodingMode.SA`` semantics without
its suffix automaton. The drafts continue the longest suffix of the text (prompt + accepted tokens) that occurred
earlier in that text, its latest occurrence on ties; a match near the end repeats periodically (``a b a b`` drafts
``a b a b ...``).

Each slot keeps its text t (length n) and a match array: ``match[j]`` = the length of the longest common suffix
of t[..j] and t[..n-1], for j < n-1 (0 elsewhere). Appending u_0..u_{w-1} is the classic incremental
longest-common-suffix recurrence: with r[j] the number of new tokens matched backwards from j
(t[j-m] == u_{w-1-m} for m < r[j]), ``new[j] = old[j-w] + w`` if r[j] == w (the suffix covers every new token and
continues as the old match w positions earlier) else ``new[j] = r[j]`` (it stops inside the new tokens). It is
exact, and it is w elementwise passes over the row with fixed shapes and no host synchronisation, so
:meth:`SuffixMatch.extend` and :meth:`SuffixMatch.propose` run inside a CUDA graph or a
``torch.compile(fullgraph=True)`` graph, and on the CPU.

At a prompt's arrival (:meth:`SuffixMatch.start`) the array is rebuilt from zero with the last
``min(initial_cap, n)`` tokens as the appended ones, so its match lengths are counted up to the cap; appends then
grow them exactly: ``match[j] = min(lcs(j), initial_cap + tokens appended since)``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def match_update(tokens: torch.Tensor, old: torch.Tensor, length_before: torch.Tensor, num_new: torch.Tensor,
                 width: int) -> torch.Tensor:
    """The match arrays after each row appended ``num_new`` tokens.

    tokens [B, L] int64: the texts, new tokens already written at length_before .. length_before + num_new - 1;
    old [B, L] int32: the match arrays before; length_before [B] int64; num_new [B] int64 in 0..width, with
    length_before + num_new <= L. Returns new [B, L] int32; a row with num_new 0 comes back unchanged."""
    max_len = tokens.shape[1]
    j = torch.arange(max_len, device=tokens.device)
    end = (length_before + num_new)[:, None]  # [B, 1] the new length
    n = num_new[:, None]  # [B, 1]
    run = torch.ones_like(tokens, dtype=torch.bool)
    matched = torch.zeros_like(old)  # r[j] = sum over m of prod over m' <= m of eq_m'[j]
    for m in range(width):
        u = tokens.gather(1, (end - 1 - m).clamp(0, max_len - 1))  # [B, 1] u_{n-1-m}
        earlier = tokens.gather(1, (j - m).clamp(min=0).expand_as(tokens))  # [B, L] t[j-m]
        run = run & (earlier == u) & (j >= m) & (m < n)
        matched = matched + run.to(old.dtype)
    shifted = old.gather(1, (j - n).clamp(min=0)) * (j >= n)  # old[j-n], 0 before the row starts
    new = torch.where(matched == n, shifted + n.to(old.dtype), matched)
    return torch.where(j < end - 1, new, 0).to(old.dtype)


class SuffixMatch(nn.Module):
    """Texts and match arrays of ``num_slots`` requests, each up to ``max_len`` tokens, as buffers that move with
    ``.to(device)``: tokens [S, L] int64, length [S] int64, match [S, L] int32.

    ``max_matching_ngram_size`` -1 drafts from the longest match (at least 1 token); N > 0 from the latest
    occurrence of the last N tokens. Slots passed in must lie in 0..S-1; graph padding rows may point at a scratch
    slot with junk tokens. Every read is masked by ``length``, and tokens past ``max_len`` are dropped (the text
    is kept as its first ``max_len`` tokens)."""

    def __init__(self, num_slots: int, max_len: int, max_matching_ngram_size: int = -1, initial_cap: int = 64):
        super().__init__()
        if max_matching_ngram_size != -1 and max_matching_ngram_size < 1:
            raise ValueError(f"max_matching_ngram_size must be -1 or positive, got {max_matching_ngram_size}")
        if initial_cap < 1:
            raise ValueError(f"initial_cap must be positive, got {initial_cap}")
        self.max_len = max_len
        self.initial_cap = initial_cap
        self.longest = max_matching_ngram_size == -1
        self.min_match = 1 if self.longest else max_matching_ngram_size
        self.register_buffer("tokens", torch.zeros(num_slots, max_len, dtype=torch.int64), persistent=False)
        self.register_buffer("length", torch.zeros(num_slots, dtype=torch.int64), persistent=False)
        self.register_buffer("match", torch.zeros(num_slots, max_len, dtype=torch.int32), persistent=False)

    def start(self, slots: torch.Tensor, tokens: torch.Tensor, lens: Sequence[int], starts: Sequence[int]) -> None:
        """Context chunks (eager): chunk c, ``lens[c]`` tokens, lands at positions ``starts[c]`` onwards of slot
        ``slots[c]`` (starts > 0 continues a chunked prompt), and the slot's match array is rebuilt up to the cap.

        slots [C] int64 and tokens [sum(lens)] int64 (the chunks, concatenated) on the device; lens and starts
        host ints, so the index tensors are built on the host without reading the device."""
        if not lens:
            return
        device = self.tokens.device
        lens_h, starts_h = torch.tensor(lens), torch.tensor(starts)
        chunk = torch.repeat_interleave(torch.arange(len(lens)), lens_h)  # [T] each token's chunk
        cols = torch.arange(len(chunk)) - (lens_h.cumsum(0) - lens_h)[chunk] + starts_h[chunk]  # [T] positions
        kept = torch.arange(len(chunk))[cols < self.max_len].to(device)  # tokens past max_len are dropped
        rows = slots[chunk.to(device)[kept]]
        self.tokens[rows, cols.to(device)[kept]] = tokens[kept]
        ends = [min(s + n, self.max_len) for s, n in zip(starts, lens)]
        capped = [min(self.initial_cap, e) for e in ends]
        length = torch.tensor(ends, device=device)
        num_new = torch.tensor(capped, device=device)
        fresh = torch.zeros(len(lens), self.max_len, dtype=self.match.dtype, device=device)
        self.match[slots] = match_update(self.tokens[slots], fresh, length - num_new, num_new, max(capped))
        self.length[slots] = length

    def prefill(self, slot: int, tokens: Sequence[int]) -> None:
        """The first tokens of a slot's prompt, reused from the prefix cache: its first chunk (:meth:`start`,
        past them) rebuilds the match array over the whole text."""
        kept = list(tokens[:self.max_len])
        self.tokens[slot, :len(kept)] = torch.tensor(kept, dtype=torch.int64).to(self.tokens.device)

    def extend(self, slots: torch.Tensor, new_tokens: torch.Tensor, num_new: torch.Tensor) -> None:
        """Append the first ``num_new[b]`` of ``new_tokens[b]`` to slot ``slots[b]`` (a row with 0 is unchanged).

        slots [B] int64; new_tokens [B, W] int64; num_new [B] int64 in 0..W. Graph-safe."""
        width = new_tokens.shape[1]
        length = self.length[slots]  # [B]
        n = num_new.clamp(0, width).minimum(self.max_len - length)  # [B] tokens past max_len are dropped
        offset = torch.arange(self.max_len, device=slots.device) - length[:, None]  # [B, L] index into new_tokens
        fresh = (offset >= 0) & (offset < n[:, None])
        rows = torch.where(fresh, new_tokens.gather(1, offset.clamp(0, width - 1)), self.tokens[slots])
        self.match[slots] = match_update(rows, self.match[slots], length, n, width)
        self.tokens[slots] = rows
        self.length[slots] = length + n

    def propose(self, slots: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k drafts per slot: the tokens after the chosen earlier occurrence, repeated with its period.

        slots [B] int64. Returns drafts [B, k] int64 and match_len [B] int64, the chosen occurrence's match length,
        0 where there is none (those drafts repeat the last token: mask them out). Graph-safe."""
        rows, match, length = self.tokens[slots], self.match[slots], self.length[slots]
        j = torch.arange(self.max_len, device=slots.device)
        candidate = (j < (length - 1)[:, None]) & (match >= self.min_match)  # [B, L]
        # longest: the largest match, then the latest j; fixed n-gram: the latest j
        score = match.to(torch.int64) * self.max_len + j if self.longest else j.expand_as(rows)
        best_score, best = torch.where(candidate, score, -1).max(dim=1)  # [B], [B]
        found = best_score >= 0
        match_len = torch.where(found, match.gather(1, best[:, None]).squeeze(1).to(torch.int64), 0)
        period = torch.where(found, length - 1 - best, 1)  # [B] >= 1
        first = torch.where(found, best + 1, length - 1)  # [B] the first draft's position
        offsets = torch.arange(k, device=slots.device)[None, :] % period[:, None]  # [B, k]
        positions = (first[:, None] + offsets).clamp(0, self.max_len - 1)
        return rows.gather(1, positions), match_len
