"""The engine: owns the model runner; admits requests (reserving KV pages), builds flat step inputs, runs the
one-model step, appends accepted tokens, stops, frees pages. Long-lived: made once per model."""
from __future__ import annotations

import numbers
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from ..config import SamplingParams
from .request import AcceptanceStats, DecodeTimer, GenerationOutputs, Request, RequestOutput
from .runner import ModelRunner

if TYPE_CHECKING:
    from ..guided.grammar import GrammarMatcher


class Engine:
    """Runs requests to completion on a :class:`ModelRunner`, batching up to ``max_batch_size`` at a time."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.kv = runner.kv_cache
        self.k = runner.max_draft_len
        self.max_seq_len = runner.max_seq_len
        self.guided_error: str | None = None  # why guided decoding is unavailable (its requests are rejected)
        self.timer = DecodeTimer()
        self._last_done = 0.0
        self._buffer = 0
        # two pinned copies of the packed outputs: one per step in flight
        rows = (runner.max_batch_size, 2 * self.k + 3)
        self._host_buffers = [torch.zeros(rows, dtype=torch.int64, pin_memory=True) for _ in range(2)] \
            if runner.device.type == "cuda" else []

    @property
    def tokenizer(self):
        return self.runner.tokenizer

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this target directory has no tokenizer: pass token-id lists instead of strings")
        return self.tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(self, prompts: Sequence[str | list[int]], sampling_params: SamplingParams
                 | Sequence[SamplingParams] | None = None, seed: int = 0, progress: bool = False
                 ) -> GenerationOutputs:
        """Decode a batch of prompts (strings need the target's tokenizer) to completion."""
        if not isinstance(prompts, (list, tuple)) or any(not isinstance(p, (str, list, tuple)) for p in prompts):
            raise TypeError("prompts must be a list of strings or of token-id lists")
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        token_prompts = [self.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if any(p.guided_decoding for p in params) and self.runner.guided_decoder is None:
            self.guided_error = self.runner.enable_guided_decoding()
        self.runner.prepare_graphs(params)  # once: warm-up and capture before the first timed step
        return self._run_to_completion(token_prompts, params, seed, progress)

    def _run_to_completion(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], seed: int,
                           progress: bool) -> GenerationOutputs:
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        waiting: deque[Request] = deque()
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            error = self._validate(prompt, p)
            matcher, error = self._grammar_matcher(p) if error is None and p.guided_decoding else (None, error)
            if error:
                warnings.warn(f"request {i} rejected: {error}", stacklevel=4)
                outputs[i] = RequestOutput(i, list(prompt), [], "rejected", AcceptanceStats(self.k), error=error)
            else:
                waiting.append(self._new_request(i, prompt, p, matcher))
        self.runner.reseed(seed)
        start, total = time.perf_counter(), AcceptanceStats(self.k)
        self.timer = DecodeTimer()
        running: list[Request] = []
        with tqdm(total=sum(r.max_total_tokens - len(r.prompt) for r in waiting), unit="tok",
                  disable=not progress, desc="generate") as bar:
            while waiting or running:
                batch = self._admit(waiting, len(running)) + running
                self._run(batch, bar, may_admit=bool(waiting) and len(batch) < self.runner.max_batch_size)
                for r in batch:
                    if r.finish_reason:
                        self.kv.free(r.slot)
                        outputs[r.index] = r.to_output(self.decode(r.output))
                        total.merge(r.stats)
                        bar.update(r.max_total_tokens - len(r.prompt) - len(r.output))
                running = [r for r in batch if not r.finish_reason]
        return self._finish(outputs, total, time.perf_counter() - start)

    def _validate(self, prompt: Sequence[int], p: SamplingParams) -> str | None:
        vocab = self.runner.vocab_size
        if len(prompt) == 0:
            return "empty prompt"
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            return "token ids must be integers"
        if min(prompt) < 0 or max(prompt) >= vocab:
            return f"token ids must lie in [0, {vocab}); got {min(prompt)}..{max(prompt)}"
        if len(prompt) + self.k + 1 > self.max_seq_len:
            return (f"prompt of {len(prompt)} tokens cannot fit: prompt + max_draft_len + 1 = "
                    f"{len(prompt) + self.k + 1} > max_seq_len = {self.max_seq_len}")
        pages = self.kv.pages_for(self._reserved_tokens(len(prompt), p))
        if pages > self.kv.max_pages_per_request or pages > self.runner.num_kv_pages - 1:
            return f"needs {pages} KV pages; the pool has {self.runner.num_kv_pages - 1}"
        return None

    def _grammar_matcher(self, p: SamplingParams) -> tuple[GrammarMatcher | None, str | None]:
        """(the request's grammar matcher, None) or (None, why its grammar cannot be used)."""
        guided = self.runner.guided_decoder
        if guided is None:
            return None, f"guided decoding unavailable: {self.guided_error}"
        try:
            return guided.matcher(p.guided_decoding), None
        except ValueError as err:
            return None, str(err)

    def _reserved_tokens(self, prompt_len: int, p: SamplingParams) -> int:
        # target writes up to K positions past the committed length; draft passes up to 2K - 1
        return min(prompt_len + p.max_new_tokens, self.max_seq_len) + 2 * self.k + 1

    def _new_request(self, index: int, prompt: Sequence[int], p: SamplingParams,
                     matcher: GrammarMatcher | None = None) -> Request:
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.runner.eos_token_ids))
        return Request(index, [int(t) for t in prompt], p, frozenset(stop_ids),
                       min(len(prompt) + p.max_new_tokens, self.max_seq_len), AcceptanceStats(self.k),
                       matcher=matcher)

    def _admit(self, waiting: deque[Request], num_running: int) -> list[Request]:
        """Move waiting requests in (FIFO) while batch slots and KV pages last."""
        admitted: list[Request] = []
        while waiting and num_running + len(admitted) < self.runner.max_batch_size:
            r = waiting[0]
            needed = self._reserved_tokens(len(r.prompt), r.params)
            if not self.kv.can_allocate(needed):
                break
            r.slot = self.kv.allocate(needed)
            admitted.append(waiting.popleft())
        if not admitted and num_running == 0:
            raise RuntimeError("no request can be admitted: KV pool smaller than one request's reservation")
        return admitted

    def _run(self, batch: list[Request], bar: tqdm, may_admit: bool) -> None:
        """Steps for ``batch`` until one of its requests ends (or the batch must change). While a graphed batch
        stays as it is, the next step is launched before the host reads this one's outputs (its inputs advanced
        on the device, :meth:`ModelRunner.run_next`), so the host's work hides behind the GPU's; a request
        that ended meanwhile has that one step's rows dropped. (That step keeps the draft length it was launched
        with: under a ``draft_len_schedule`` the batch's new size takes effect one step later.)"""
        step = self._launch(batch)
        while True:
            ahead = self._launch_next(step) if self._can_run_ahead(step, may_admit) else None
            self._complete(batch, step, bar)
            if ahead is None:
                return
            step = ahead
            if any(r.finish_reason for r in batch):
                self._complete(batch, step, bar)
                return

    def _can_run_ahead(self, step: _Launched, may_admit: bool) -> bool:
        """A generation-only batch (graphed, where there is a runner: every batch size has a bucket) that keeps
        its draft length and has no grammar, with no waiting request it could admit. (A step run ahead for a
        request that has just ended writes K/V at most K + 1 positions past what the request reserved: into the
        scratch page, :attr:`ModelRunner.max_positions_per_request`.)"""
        return not step.has_context and not may_admit and self.runner.can_run_next()

    def _launch(self, batch: list[Request]) -> _Launched:
        """Build the step's flat inputs on the host (context requests first) and launch it. Generation requests
        verify the drafts they hold (every running request holds as many: the previous step proposed them for
        all) and the step proposes the schedule's number for this batch size."""
        start = time.perf_counter()
        contexts = [r for r in batch if r.is_context]
        generating = [r for r in batch if not r.is_context]
        draft_len = len(generating[0].next_input) - 1 if generating else self.k
        next_draft_len = self.runner.draft_len_for(len(batch))
        ids, positions, slots = [], [], []
        for r in batch:
            tokens = r.prompt if r.is_context else r.next_input
            ids += tokens
            positions += range(r.num_cached, r.num_cached + len(tokens))
            slots += [r.slot] * len(tokens)
        drafts = [t for r in batch if not r.is_context for t in r.next_input[1:]]
        if self.runner.guided_decoder is not None:  # grammar masks for this step, filled before it runs
            self.runner.guided_decoder.build([r.matcher for r in batch],
                                                   [[] if r.is_context else r.next_input[1:] for r in batch])
        packed = self.runner.step(ids, positions, slots, drafts, [r.params for r in batch],
                                 tuple(len(r.prompt) for r in contexts), draft_len, next_draft_len)
        return self._copy_out(packed, start, draft_len, next_draft_len, bool(contexts), chained=False)

    def _launch_next(self, step: _Launched) -> _Launched:
        start = time.perf_counter()
        packed = self.runner.run_next()
        return self._copy_out(packed, start, step.draft_len, step.next_draft_len, False, chained=True)

    def _copy_out(self, packed: torch.Tensor, start: float, draft_len: int, next_draft_len: int, has_context: bool,
                  chained: bool) -> _Launched:
        """Queue the step's one device-to-host copy (into the pinned buffer not in use) behind its kernels."""
        if not packed.is_cuda:  # a copy: a static output buffer is overwritten by the next replay
            return _Launched(packed.clone(), None, draft_len, next_draft_len, has_context, chained, start,
                             time.perf_counter() - start)
        self._buffer ^= 1
        host = self._host_buffers[self._buffer][:packed.shape[0]]
        host.copy_(packed, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _Launched(host, ready, draft_len, next_draft_len, has_context, chained, start,
                         time.perf_counter() - start)

    def _complete(self, batch: list[Request], step: _Launched, bar: tqdm) -> None:
        """Wait for the step's outputs and update its requests on the host (a request that has already ended
        skips its rows: they come from a step launched ahead)."""
        if step.ready is not None:
            step.ready.synchronize()
        waited = time.perf_counter()
        live = [not r.finish_reason for r in batch]
        for r, row, used in zip(batch, step.host.tolist(), live):
            if not used:
                continue
            n = row[self.k + 1]
            if r.is_context:
                r.num_cached = len(r.prompt)
            else:
                r.num_cached += n
                if step.draft_len or not self.k:  # a speculative step scheduled without drafts is not counted
                    r.stats.record(n, step.draft_len)
            r.next_input = row[self.k + 2:self.k + 3 + step.next_draft_len]
            before = len(r.output)
            r.accept(row[:n])
            bar.update(len(r.output) - before)
        done = time.perf_counter()
        if not step.has_context and any(live):  # a chained step's time runs from the previous step's end
            began = self._last_done if step.chained else step.start
            self.timer.record(done - began, step.host_seconds + (done - waited), sum(live))
        self._last_done = done

    def _finish(self, outputs: list[RequestOutput | None], total: AcceptanceStats,
                seconds: float) -> GenerationOutputs:
        result = GenerationOutputs(outputs)
        num_tokens = sum(len(o.token_ids) for o in outputs)
        result.stats = {"num_requests": len(outputs), "num_tokens": num_tokens, "seconds": round(seconds, 4),
                        "tokens_per_second": round(num_tokens / seconds, 2) if seconds > 0 else 0.0,
                        **total.summary(), **self.timer.summary()}
        return result


@dataclass
class _Launched:
    """A launched step: its packed outputs on the host [B, 2K+3] int64 (valid once ``ready`` has passed; None:
    already there), how it was launched, and the host time spent launching it."""

    host: torch.Tensor
    ready: torch.cuda.Event | None
    draft_len: int
    next_draft_len: int
    has_context: bool  # a step with prompts: never graphed, never timed as a decode step
    chained: bool  # launched by run_next, before the step before it was read
    start: float
    host_seconds: float
