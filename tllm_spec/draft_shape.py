"""The shape of what a step drafts, as the configs and the engine check it: draft-length schedules by batch size
and the fields of a draft tree (TensorRT-LLM's rules, with clear errors)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .drafts.tree import DraftTree

SCHEDULE_DESCRIPTION = (
    "drafts per step by batch size (TensorRT-LLM's draft_len_schedule): {1: 3, 32: 2, 128: 0} drafts 3 tokens "
    "for batches of 1-31 requests, 2 for 32-127 and none from 128 on (the target then verifies no drafts; the "
    "draft network still reads the step so its cache stays whole). Must have the key 1; lengths lie in "
    "0..max_draft_len. None: max_draft_len at every batch size. scripts/benchmark.py --draft-len-sweep measures "
    "one for a GPU and a model shape. With a draft tree (N = max_total_draft_tokens) an entry of N drafts the "
    "tree and a smaller one a chain, e.g. {1: N, 8: 3, 64: 0}")


def check_draft_len_schedule(schedule: dict[int, int] | None, max_draft_len: int, tree_size: int | None = None
                             ) -> None:
    """``tree_size``: a draft tree's N, where an entry of N drafts the tree and a smaller one a chain (at most
    max_draft_len, the tree's depth, and below N)."""
    if schedule is None:
        return
    if 1 not in schedule:
        raise ValueError(f"draft_len_schedule must give batch size 1 a draft length, got {schedule}")
    chain_max = max_draft_len if tree_size is None else min(max_draft_len, tree_size - 1)
    bad = {b: k for b, k in schedule.items() if b < 1 or not (0 <= k <= chain_max or k == tree_size)}
    if bad:
        lengths = f"0..{chain_max}" if tree_size is None else f"{tree_size} (the tree) or 0..{chain_max} (a chain)"
        raise ValueError(f"draft_len_schedule: batch sizes must be >= 1 and draft lengths {lengths}; got {bad}")


def check_tree_fields(max_draft_len: int, total: int | None, static_tree: DraftTree | None, use_dynamic_tree: bool,
                      top_k: int | None) -> None:
    """The tree fields of an EAGLE-3 config agree with each other and with max_draft_len: ``total`` is
    max_total_draft_tokens, ``static_tree`` the tree of eagle_choices (None without), ``top_k``
    dynamic_tree_max_topK."""
    if static_tree is not None and use_dynamic_tree:
        raise ValueError("eagle_choices (a static tree) and use_dynamic_tree exclude each other")
    if static_tree is not None:
        if static_tree.max_depth != max_draft_len:
            raise ValueError(f"eagle_choices are {static_tree.max_depth} deep; max_draft_len must equal that, got "
                             f"{max_draft_len}")
        if total is not None and total != static_tree.num_nodes:
            raise ValueError(f"eagle_choices have {static_tree.num_nodes} nodes; max_total_draft_tokens must equal "
                             f"that (or be left out), got {total}")
    if use_dynamic_tree:
        if top_k is None or total is None:
            raise ValueError("use_dynamic_tree needs dynamic_tree_max_topK and max_total_draft_tokens")
        if total < max_draft_len:
            raise ValueError(f"max_total_draft_tokens ({total}) must be at least max_draft_len ({max_draft_len}): "
                             f"the tree holds a path of that depth")
        candidates = top_k + (max_draft_len - 1) * top_k ** 2  # what growing proposes: k, then k * k a depth
        if total > candidates:
            raise ValueError(f"max_total_draft_tokens ({total}) exceeds the {candidates} candidates a dynamic tree "
                             f"of depth {max_draft_len} and dynamic_tree_max_topK {top_k} grows")
        if (max_draft_len - 1) * top_k > total:
            raise ValueError(f"a dynamic tree drafts with (max_draft_len - 1) * dynamic_tree_max_topK = "
                             f"{(max_draft_len - 1) * top_k} frontier tokens, which must fit the "
                             f"max_total_draft_tokens = {total} cache rows a step reserves")
    elif top_k is not None:
        raise ValueError("dynamic_tree_max_topK applies to use_dynamic_tree=True only")
    if static_tree is None and not use_dynamic_tree and total not in (None, max_draft_len):
        raise ValueError(f"a chain drafts max_draft_len tokens: max_total_draft_tokens must be {max_draft_len} or "
                         f"left out without eagle_choices / use_dynamic_tree, got {total}")
