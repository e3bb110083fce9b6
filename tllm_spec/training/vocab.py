"""The draft vocabulary: the most frequent target tokens, stored as EAGLE-3's ``d2t`` / ``t2d``.

``d2t`` [draft_vocab] int64 holds offsets: draft id i is target id ``i + d2t[i]`` (the ids are kept sorted,
so the offsets are non-negative and non-decreasing); ``t2d`` [vocab] bool marks the target ids that have a
draft id.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftVocab:
    d2t: torch.Tensor  # [draft_vocab] int64 offsets
    t2d: torch.Tensor  # [vocab] bool

    @property
    def draft_ids(self) -> torch.Tensor:
        """[draft_vocab] int64: the target id of each draft id."""
        return draft_to_target(self.d2t)

    @property
    def size(self) -> int:
        return self.d2t.numel()


def token_counts(stream: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64 occurrences of each id in ``stream`` [N]."""
    if stream.numel() and int(stream.max()) >= vocab_size:
        raise ValueError(f"token id {int(stream.max())} outside the target vocabulary of {vocab_size}")
    return torch.bincount(stream.long(), minlength=vocab_size)


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int, always: Iterable[int] = ()) -> DraftVocab:
    """The ``draft_vocab_size`` most frequent ids of ``counts`` [V] (ties: the lower id), with the ``always``
    ids (e.g. EOS) forced in. ``draft_vocab_size >= V`` gives the identity map."""
    vocab_size = counts.numel()
    if draft_vocab_size >= vocab_size:
        return DraftVocab(torch.zeros(vocab_size, dtype=torch.int64), torch.ones(vocab_size, dtype=torch.bool))
    forced = sorted(set(int(i) for i in always))
    if len(forced) > draft_vocab_size or any(not 0 <= i < vocab_size for i in forced):
        raise ValueError(f"always-included ids {forced} do not fit a draft vocabulary of {draft_vocab_size}")
    score = counts.double().clone()
    score[forced] = float("inf")
    order = torch.sort(-score, stable=True).indices  # descending count, ascending id among ties
    ids = order[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return DraftVocab(ids - torch.arange(draft_vocab_size), t2d)


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """[draft_vocab] target ids from [draft_vocab] offsets."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t.long()


def target_to_draft(t2d: torch.Tensor) -> torch.Tensor:
    """[vocab] int64: the draft id of each target id, -1 where it has none."""
    out = torch.full(t2d.shape, -1, dtype=torch.int64, device=t2d.device)
    out[t2d] = torch.arange(int(t2d.sum()), device=t2d.device)
    return out
