"""Draft length by batch size (``draft_len_schedule``): larger batches draft fewer tokens, where the verify
step stops being memory-bound."""
from __future__ import annotations

import bisect
import math
from collections.abc import Mapping

from ..draft_shape import check_draft_len_schedule


class DraftLenSchedule:
    """{smallest batch size: draft length}; without a schedule every batch drafts ``max_draft_len``. Mutable
    (benchmark sweeps replace it), shared by the runner and its CUDA graphs, which key graphs by draft length."""

    def __init__(self, max_draft_len: int, schedule: Mapping[int, int] | None = None, fixed: bool = False,
                 tree_depth: int | None = None):
        self.max_draft_len = max_draft_len  # a draft tree's N (its entry drafts the tree)
        self.fixed = fixed  # vanilla MTP drafts exactly num_nextn_predict_layers tokens
        self.tree_depth = tree_depth  # a draft tree's: smaller entries are chains at most this long
        self._entries: list[tuple[int, int]] = []  # [(smallest batch size, k)], sorted
        self.set(schedule)

    def set(self, schedule: Mapping[int, int] | None) -> None:
        """Replace the schedule (the config's rules apply)."""
        if schedule is not None and self.fixed:
            raise ValueError("draft_len_schedule: vanilla MTP drafts exactly num_nextn_predict_layers tokens")
        schedule = dict(schedule) if schedule is not None else None
        if self.tree_depth is None:
            check_draft_len_schedule(schedule, self.max_draft_len)
        else:
            check_draft_len_schedule(schedule, self.tree_depth, tree_size=self.max_draft_len)
        self._entries = sorted((schedule or {1: self.max_draft_len}).items())

    def draft_len_for(self, batch_size: int) -> int:
        """Drafts per request for a step of ``batch_size`` requests: the entry with the largest batch-size key
        <= batch_size."""
        return self._entries[bisect.bisect_right(self._entries, (batch_size, math.inf)) - 1][1]

    def as_dict(self) -> dict[int, int]:
        """{smallest batch size: draft length} in effect (``{1: max_draft_len}`` without a schedule)."""
        return dict(self._entries)
