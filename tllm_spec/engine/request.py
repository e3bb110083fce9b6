"""Requests in flight, their outputs, and acceptance statistics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import SamplingParams
from .detokenizer import Detokenizer

if TYPE_CHECKING:
    from ..guided.grammar import GrammarMatcher


@dataclass
class AcceptanceStats:
    """Accepted tokens per generation step (bonus included): n in 1..k+1, k the step's drafts (K = max_draft_len
    unless a draft-length schedule shortened the step)."""

    max_draft_len: int
    accepted_per_step: list[int] = field(default_factory=list)
    drafts_per_step: list[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not prefilled)

    def record(self, num_accepted: int, num_drafts: int | None = None) -> None:
        self.accepted_per_step.append(num_accepted)
        self.drafts_per_step.append(self.max_draft_len if num_drafts is None else num_drafts)

    def merge(self, other: AcceptanceStats) -> None:
        self.accepted_per_step.extend(other.accepted_per_step)
        self.drafts_per_step.extend(other.drafts_per_step)
        self.cached_prompt_tokens += other.cached_prompt_tokens

    @property
    def num_steps(self) -> int:
        return len(self.accepted_per_step)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per generation step, bonus included (1.0 = nothing accepted)."""
        return sum(self.accepted_per_step) / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Fraction of the steps that drafted position j (1-based) in which draft j was accepted, j = 1..K."""
        rates = []
        for j in range(1, self.max_draft_len + 1):
            drafted = [n for n, k in zip(self.accepted_per_step, self.drafts_per_step) if k >= j]
            rates.append(sum(n - 1 >= j for n in drafted) / max(len(drafted), 1))
        return rates

    @property
    def histogram(self) -> list[int]:
        """Steps that accepted 0, 1, ..., K drafts."""
        counts = [0] * (self.max_draft_len + 1)
        for n in self.accepted_per_step:
            counts[n - 1] += 1
        return counts

    def summary(self) -> dict[str, object]:
        return {"steps": self.num_steps, "mean_accepted_length": round(self.mean_accepted_length, 4),
                "acceptance_rate_per_position": [round(r, 4) for r in self.acceptance_rate_per_position],
                "histogram": self.histogram}


TokenLogprobs = tuple[list[float], list[dict[int, float]]]  # per token: its logprob; the top N {token id: logprob}


@dataclass
class RequestOutput:
    """What generate() returns per prompt. ``finish_reason``: "stop" (a stop token or stop string, or the
    request's grammar is complete), "length", "abort", "rejected" or "error" (see ``error``). With
    ``SamplingParams(logprobs=N)``: ``logprobs`` (each output token's logprob under the target) and
    ``top_logprobs`` (each position's N most likely tokens, {token id: logprob} best first), one per token."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    stats: AcceptanceStats
    text: str | None = None
    error: str | None = None
    request_id: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None


@dataclass
class StreamOutput:
    """One step's news of a request: the tokens it accepted (``token_ids``, 1..K+1 of them, fewer where a stop
    ended it) and the text they completed (``text``: a delta; None without a tokenizer). The last one has
    ``finished`` set and ``output`` (the whole RequestOutput); ``exception`` is what a failed step raised.
    ``logprobs`` / ``top_logprobs``: the new tokens' entries (None unless the request asked for logprobs)."""

    request_id: str
    token_ids: list[int]
    text: str | None
    finished: bool = False
    output: RequestOutput | None = None
    exception: BaseException | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    cached_prompt_tokens: int = 0  # the request's prompt tokens the prefix cache served (known from admission on)

    @classmethod
    def merged(cls, outs: list[StreamOutput]) -> StreamOutput:
        """Consecutive outputs of one request as one (a consumer that fell behind takes what queued up at once):
        tokens, text and logprobs joined; finished, output and exception of the last."""
        if len(outs) == 1:
            return outs[0]
        last = outs[-1]
        texts = [o.text for o in outs if o.text is not None]
        with_logprobs = [o for o in outs if o.logprobs is not None]
        return cls(last.request_id, [t for o in outs for t in o.token_ids], "".join(texts) if texts else None,
                   last.finished, last.output, last.exception,
                   [x for o in with_logprobs for x in o.logprobs] if with_logprobs else None,
                   [x for o in with_logprobs for x in o.top_logprobs] if with_logprobs else None,
                   last.cached_prompt_tokens)

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason if self.output is not None else None


@dataclass
class Request:
    """Engine-side state of one request."""

    index: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    max_total_tokens: int  # prompt + generated may not exceed this (max_seq_len and max_new_tokens)
    stats: AcceptanceStats
    request_id: str = ""
    slot: int = -1
    num_cached: int = 0  # positions whose target K/V are committed
    next_input: list[int] = field(default_factory=list)  # [last token, drafts] for the next step
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    exception: BaseException | None = None
    matcher: GrammarMatcher | None = None  # the request's grammar state (guided decoding), advanced on the host
    detokenizer: Detokenizer | None = None  # text and stop strings; None without a tokenizer
    num_emitted: int = 0  # output tokens already handed out as StreamOutputs
    logprobs: list[float] | None = None  # per output token (SamplingParams.logprobs set): its logprob
    top_logprobs: list[dict[int, float]] | None = None  # per output token: the top N {token id: logprob}
    arrival: float = 0.0  # when the engine queued it (AdmissionPolicy.clock)
    page_keys: list[bytes] | None = None  # its prompt pages' prefix-cache keys (PrefixCache.keys_of)
    num_published: int = 0  # its first pages that are cached (reused or published by it)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs, self.top_logprobs = [], []

    @property
    def is_context(self) -> bool:
        """Its prompt is not all cached yet (chunked prefill takes it over one or more steps)."""
        return self.num_cached < len(self.prompt)

    def append(self, tokens: list[int]) -> None:
        """Append accepted tokens, stopping at a stop id, a stop string or the length limit (the rest is
        trimmed)."""
        kept = []
        for token in tokens:
            kept.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
            elif len(self.prompt) + len(self.output) + len(kept) >= self.max_total_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        if self.detokenizer is not None:
            kept = kept[:self.detokenizer.push(kept)]
            self.finish_reason = "stop" if self.detokenizer.stopped else self.finish_reason
        self.output.extend(kept)

    def accept(self, tokens: list[int], logprobs: TokenLogprobs | None = None) -> None:
        """Append a step's accepted tokens, first following them through the grammar (which may end the request
        at its completion); ``logprobs``: theirs, one entry per token, trimmed with them (every cut keeps a
        prefix)."""
        grammar_finish, num_before = None, len(self.output)
        if self.matcher is not None:
            tokens, grammar_finish = self.matcher.advance(tokens)
        self.append(tokens)
        self.finish_reason = self.finish_reason or grammar_finish
        if self.logprobs is not None:
            num_kept = len(self.output) - num_before
            self.logprobs.extend(logprobs[0][:num_kept])
            self.top_logprobs.extend(logprobs[1][:num_kept])

    def fail(self, reason: str, error: str | None = None, exception: BaseException | None = None) -> None:
        """End the request now ("abort", "error")."""
        self.finish_reason, self.error, self.exception = reason, error, exception

    def stream_output(self) -> StreamOutput:
        """The tokens and text not handed out yet; with the whole output once the request has finished."""
        finished = self.finish_reason is not None
        if finished and self.detokenizer is not None:
            self.detokenizer.finish()
        text = self.detokenizer.take_delta(finished) if self.detokenizer is not None else None
        start, self.num_emitted = self.num_emitted, len(self.output)
        logprobs, top = (None, None) if self.logprobs is None else (self.logprobs[start:], self.top_logprobs[start:])
        return StreamOutput(self.request_id, self.output[start:], text, finished,
                            self.to_output() if finished else None, self.exception, logprobs, top,
                            self.stats.cached_prompt_tokens)

    def to_output(self) -> RequestOutput:
        error = self.error or ("an accepted token broke the grammar (forced or relaxed acceptance)"
                               if self.finish_reason == "error" else None)
        text = self.detokenizer.text if self.detokenizer is not None else None
        return RequestOutput(self.index, self.prompt, self.output, self.finish_reason or "length", self.stats, text,
                             error, self.request_id, self.logprobs, self.top_logprobs)


class GenerationOutputs(list):
    """``list[RequestOutput]`` plus ``stats``: aggregate acceptance and throughput of the call."""

    stats: dict[str, object]


@dataclass
class DecodeTimer:
    """Wall time of generation-only steps; host time = the step minus its wait for the device."""

    steps: int = 0
    seconds: float = 0.0
    host_seconds: float = 0.0
    request_steps: int = 0

    def record(self, seconds: float, host_seconds: float, batch_size: int) -> None:
        self.steps += 1
        self.seconds += seconds
        self.host_seconds += host_seconds
        self.request_steps += batch_size

    def minus(self, before: DecodeTimer) -> DecodeTimer:
        """The steps recorded since ``before`` was copied."""
        return DecodeTimer(self.steps - before.steps, self.seconds - before.seconds,
                           self.host_seconds - before.host_seconds, self.request_steps - before.request_steps)

    def summary(self) -> dict[str, float]:
        steps = max(self.steps, 1)
        return {"decode_steps": self.steps, "decode_seconds": round(self.seconds, 6),
                "step_ms": round(1e3 * self.seconds / steps, 4),
                "host_ms_per_step": round(1e3 * self.host_seconds / steps, 4),
                "mean_decode_batch": round(self.request_steps / steps, 3)}
