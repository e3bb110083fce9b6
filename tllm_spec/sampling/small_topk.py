"""The k largest of each row for a draft tree's few children (k <= 64) over a vocabulary, in a handful of launches.

On CUDA, ``torch.topk`` of a few long rows (a tree's parents over a 32k-128k vocabulary) takes its multi-block radix
select: about twenty launches a call, most of a tree step's extra launches. Cut into short slices, the same top-k
is two single-block selections: the k largest of every slice (unsorted), then the k largest of those candidates
(sorted), whose values and indices are the row's. Slices of at most _MAX_SLICE keep both selections single-block
at every number of rows a step has (torch picks its multi-block path from the slice length and count).
Elsewhere (the CPU path and the reference) it is ``torch.topk`` itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_MAX_SLICE = 384  # keys per slice of the first selection
_MIN_SLICE = 128  # a vocabulary without a divisor from here up is padded to a multiple of _PAD_SLICE instead
_PAD_SLICE = 256


def small_topk(x: torch.Tensor, k: int, sliced: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest along the last dim, largest first, as ``x.topk(k, dim=-1)``
    (equal values may come in another order). ``sliced``: take the two-selection path (None: on CUDA only)."""
    if sliced is None:
        sliced = x.is_cuda
    vocab = x.shape[-1]
    slice_len = _slice_len(vocab, k)
    if not sliced or k > _MIN_SLICE or vocab <= _MAX_SLICE:
        return x.topk(k, dim=-1)
    if slice_len is None:  # pad to whole slices with the lowest value (never among the k largest of a row)
        slice_len = _PAD_SLICE
        x = F.pad(x, (0, -vocab % slice_len), value=float("-inf"))
    pieces = x.shape[-1] // slice_len
    values, local = x.unflatten(-1, (pieces, slice_len)).topk(k, dim=-1, sorted=False)  # [..., P, k]
    offsets = torch.arange(0, pieces * slice_len, slice_len, device=x.device)[:, None]
    top_values, picks = values.flatten(-2).topk(k, dim=-1)  # [..., k], sorted
    return top_values, (local + offsets).flatten(-2).gather(-1, picks)


def _slice_len(vocab: int, k: int) -> int | None:
    """The longest slice of at most _MAX_SLICE (and at least _MIN_SLICE and k) that divides ``vocab``."""
    for length in range(_MAX_SLICE, max(_MIN_SLICE, k) - 1, -1):
        if vocab % length == 0:
            return length
    return None
