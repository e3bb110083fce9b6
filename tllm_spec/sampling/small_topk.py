"""The k largest of each row for a draft tree's few children (k <= 64) over a vocabulary, in a handful of launches.

On CUDA, ``torch.topk`` of a few long rows (a tree's parents over a 32k-128k vocabulary) takes its multi-block radix
select: about twenty launches a call, most of a tree step's extra launches. Cut into short slices, the same top-k
is two single-block selections: the k largest of every slice (unsorted), then the k largest of those candidates
(sorted), whose values and indices are the row's. Slices of at most _MAX_SLICE keep both selections single-block
at every number of rows a step has (torch picks its multi-block path from the slice length and count). A
vocabulary that is not a whole number of slices leaves a tail, whose own k largest join the candidates (padding
would tie with a row's -inf entries and could hand out an index past the vocabulary).
Elsewhere (the CPU path and the reference) it is ``torch.topk`` itself.
"""
from __future__ import annotations

import torch

_MAX_SLICE = 384  # keys per slice of the first selection
_MIN_SLICE = 128  # the shortest slice looked for among the vocabulary's divisors (else slices of _MAX_SLICE)


def small_topk(x: torch.Tensor, k: int, sliced: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest along the last dim, largest first, as ``x.topk(k, dim=-1)``
    (equal values may come in another order). ``sliced``: take the two-selection path (None: on CUDA only)."""
    if sliced is None:
        sliced = x.is_cuda
    vocab = x.shape[-1]
    if not sliced or k > _MIN_SLICE or vocab <= 2 * _MAX_SLICE:
        return x.topk(k, dim=-1)
    slice_len = _slice_len(vocab)
    pieces = vocab // slice_len
    whole = pieces * slice_len
    values, local = x[..., :whole].unflatten(-1, (pieces, slice_len)).topk(k, dim=-1, sorted=False)  # [..., P, k]
    values = values.flatten(-2)
    indices = (local + torch.arange(0, whole, slice_len, device=x.device)[:, None]).flatten(-2)
    if whole < vocab:  # the tail's own candidates
        tail_values, tail = x[..., whole:].topk(min(k, vocab - whole), dim=-1, sorted=False)
        values, indices = torch.cat([values, tail_values], -1), torch.cat([indices, tail + whole], -1)
    top_values, picks = values.topk(k, dim=-1)  # [..., k], sorted
    return top_values, indices.gather(-1, picks)


def _slice_len(vocab: int) -> int:
    """The longest slice of at most _MAX_SLICE (and at least _MIN_SLICE) that divides ``vocab``, else
    _MAX_SLICE (a tail is left)."""
    for length in range(_MAX_SLICE, _MIN_SLICE - 1, -1):
        if vocab % length == 0:
            return length
    return _MAX_SLICE
