"""Chunked prefill: which requests and prompt tokens enter a step. Context requests (prompt not all cached) get
their next prompt chunk, FIFO, while the step's budget of prompt tokens (``max_num_batched_tokens``) lasts; every
generation request runs in the same step, so a long prompt never stalls running streams for more than a chunk."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .request import Request


@dataclass(frozen=True)
class ContextChunk:
    """Prompt positions [start, start + length) of a context request, prefilled in one step."""

    request: Request
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def is_last(self) -> bool:
        """The chunk ends its prompt: the step samples the request's first token and drafts after it."""
        return self.end == len(self.request.prompt)

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt[self.start:self.end]

    def next_tokens(self, lookahead: int) -> tuple[int, ...]:
        """The ``lookahead`` prompt tokens after a partial chunk, which its draft pass reads; () for the last."""
        return () if self.is_last else tuple(self.request.prompt[self.end:self.end + lookahead])


@dataclass(frozen=True)
class StepPlan:
    """One step's requests in the flat layout's order: the context chunks first, then the generation requests."""

    chunks: list[ContextChunk]
    generating: list[Request]

    @property
    def requests(self) -> list[Request]:
        return [c.request for c in self.chunks] + self.generating

    def flat_inputs(self) -> tuple[list[int], list[int], list[int]]:
        """(token ids, positions, KV slots), one entry per token: each chunk's prompt tokens, then each
        generation request's [last accepted token, drafts]."""
        runs = [(c.request, c.tokens, c.start) for c in self.chunks]
        runs += [(r, r.next_input, r.num_cached) for r in self.generating]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for request, tokens, start in runs:
            ids += tokens
            positions += range(start, start + len(tokens))
            slots += [request.slot] * len(tokens)
        return ids, positions, slots


def plan_step(batch: Sequence[Request], budget: int, lookahead: int) -> StepPlan:
    """The step for the live requests of ``batch`` (in admission order): prompt chunks within ``budget`` tokens
    (:func:`schedule_chunks`), and every generation request."""
    live = [r for r in batch if not r.finish_reason]
    return StepPlan(schedule_chunks([r for r in live if r.is_context], budget, lookahead),
                    [r for r in live if not r.is_context])


def schedule_chunks(contexts: Sequence[Request], budget: int, lookahead: int) -> list[ContextChunk]:
    """FIFO over ``contexts``: each request's next chunk while ``budget`` prompt tokens last. A chunk that does not
    end its prompt stops at least ``lookahead`` tokens before the prompt's end (the draft pass reads those tokens;
    SpecWorkerBase.context_lookahead). The first request always progresses: where the budget cannot leave it
    that many, it takes its whole remainder (at most ``lookahead`` - 1 tokens over the budget)."""
    chunks: list[ContextChunk] = []
    for r in contexts:
        if budget <= 0:
            break
        remaining = len(r.prompt) - r.num_cached
        length = remaining if remaining <= budget else max(0, min(budget, remaining - lookahead))
        if length == 0 and not chunks:
            length = remaining
        if length:
            chunks.append(ContextChunk(r, r.num_cached, length))
            budget -= length
    return chunks
