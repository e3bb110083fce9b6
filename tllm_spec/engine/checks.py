"""Why a request cannot run: its sampling params, its prompt and its size against the engine's limits. Read-only,
so any thread may ask before a request is queued (a refused one ends alone, finish_reason "rejected")."""
from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..config import SamplingParams

if TYPE_CHECKING:
    from .runner import ModelRunner


def refusal(prompt: Sequence[int], params: SamplingParams, runner: ModelRunner,
            pages_for: Callable[[int, SamplingParams], int]) -> str | None:
    """Why this request cannot run (None: it can). ``pages_for(prompt_len, params)``: the KV pages it reserves."""
    if not isinstance(params, SamplingParams):
        return f"sampling params must be a SamplingParams, got {type(params).__name__}"
    try:  # again: model_copy(update=...) skips validation (a NaN temperature would decode garbage)
        SamplingParams.model_validate(dict(params))
    except ValueError as err:
        return f"invalid sampling params: {err}".replace("\n", "; ")
    vocab = runner.vocab_size
    if params.stop and runner.tokenizer is None:
        return "stop strings need a tokenizer; this target directory has none (use stop_token_ids)"
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
    if bad:
        return f"stop_token_ids must lie in [0, {vocab}); got {bad}"
    if len(prompt) == 0:
        return "empty prompt"
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
        return "token ids must be integers"
    if min(prompt) < 0 or max(prompt) >= vocab:
        return f"token ids must lie in [0, {vocab}); got {min(prompt)}..{max(prompt)}"
    k, max_seq_len = runner.max_draft_len, runner.max_seq_len
    if len(prompt) + k + 1 > max_seq_len:
        return (f"prompt of {len(prompt)} tokens cannot fit: prompt + max_draft_len + 1 = "
                f"{len(prompt) + k + 1} > max_seq_len = {max_seq_len}")
    pages = pages_for(len(prompt), params)
    if pages > runner.kv_cache.max_pages_per_request or pages > runner.num_kv_pages - 1:
        return f"needs {pages} KV pages; the pool has {runner.num_kv_pages - 1}"
    return None
