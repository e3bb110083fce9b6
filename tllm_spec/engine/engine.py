"""The engine: owns the model runner; admits requests (reserving KV pages), builds flat step inputs, runs the
one-model step, appends accepted tokens, stops, frees pages. Long-lived, and driven by one thread (the
:class:`EngineLoop`'s): requests join the running batch at step boundaries, each step's tokens go out as
:class:`StreamOutput` through ``on_output``, and every way out of a step returns what its requests hold."""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ..config import SamplingParams
from ..sampling.logprobs import StepLogprobs
from .admission import AdmissionPolicy
from .checks import refusal
from .detokenizer import Detokenizer
from .prefix_cache import PrefixCache
from .request import AcceptanceStats, DecodeTimer, Request, StreamOutput
from .runner import ModelRunner
from .scheduler import StepPlan, plan_step
from .step_log import LaunchedStep, StepLog

if TYPE_CHECKING:
    from ..guided.grammar import GrammarMatcher


class Engine:
    """Runs requests on a :class:`ModelRunner`, batching up to ``max_batch_size`` at a time. Not thread-safe:
    one thread calls :meth:`add`, :meth:`abort` and :meth:`step` (:class:`EngineLoop` owns that thread);
    :meth:`check` is read-only and may be called from any thread."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.kv = runner.kv_cache
        self.k = runner.max_draft_len
        self.max_accepted_drafts = runner.max_accepted_drafts  # acceptance statistics' width (a tree's depth)
        self.max_seq_len = runner.max_seq_len
        self.max_num_batched_tokens = runner.engine_config.max_num_batched_tokens  # prompt tokens per step
        self.admission = AdmissionPolicy(runner.engine_config)
        self.prefix_cache = PrefixCache.of(runner)
        self.guided_error: str | None = None  # why guided decoding is unavailable (its requests are rejected)
        self.timer = DecodeTimer()  # every decode step since the engine was made
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.on_output: Callable[[StreamOutput], None] = lambda out: None
        # between steps run ahead: take news (EngineLoop queues new requests here); True: stop running ahead
        self.should_yield: Callable[[], bool] = lambda: False
        self.step_log: StepLog | None = None  # set one to record every step (StepLog)
        self._ids = itertools.count()
        self._tokenizer_lock = threading.Lock()
        self._last_done = 0.0
        self._buffer = 0
        # two pinned copies of the packed outputs, as wide as the widest: one per step in flight
        size = runner.max_batch_size * runner.max_packed_columns
        self._host_buffers = [torch.zeros(size, dtype=torch.int64, pin_memory=True) for _ in range(2)] \
            if runner.device.type == "cuda" else []

    tokenizer = property(lambda self: self.runner.tokenizer)

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def encode(self, text: str) -> list[int]:
        """Any thread: the tokenizer is used under one lock (a Rust tokenizer refuses concurrent borrows)."""
        if self.tokenizer is None:
            raise ValueError("this target directory has no tokenizer: pass token-id lists instead of strings")
        with self._tokenizer_lock:
            return self.tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        with self._tokenizer_lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def decode_each(self, token_ids: list[int]) -> list[str]:
        """Any thread: each token's own text, special tokens included (logprobs' token strings)."""
        with self._tokenizer_lock:
            return [self.tokenizer.decode([t]) for t in token_ids]

    def check(self, prompt: Sequence[int], params: SamplingParams) -> str | None:
        """Why this request cannot run (None: it can). Read-only: any thread may ask."""
        return refusal(prompt, params, self.runner, lambda n, p: self.kv.pages_for(self._reserved_tokens(n, p)))

    def add(self, index: int, prompt: Sequence[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request (checked with :meth:`check` first); returns its id. Its grammar is compiled here: a
        grammar the backend refuses ends the request at once as "rejected"."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if params.guided_decoding is not None and self.runner.guided_decoder is None:
            self.guided_error = self.runner.enable_guided_decoding()
        matcher, error = self._grammar_matcher(params) if params.guided_decoding else (None, None)
        request = self._new_request(index, prompt, params, request_id, matcher)
        if error:
            request.fail("rejected", error)
            self.on_output(request.stream_output())
        else:
            self.runner.prepare_graphs([params])  # a sampling variant seen for the first time: capture it now
            self.waiting.append(request)
        return request_id

    def joins_quietly(self, params: SamplingParams) -> bool:
        """Whether a request with ``params`` may be added while a step is in flight (:meth:`add` between steps run
        ahead): it sets up no grammar and captures no graph."""
        return params.guided_decoding is None and not self.runner.needs_capture(params)

    def abort(self, request_id: str) -> bool:
        """End a request now ("abort"): a waiting one leaves the queue, a running one leaves the batch and frees
        its pages at the end of the step in flight. False if no such request is queued or running."""
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                r.fail("abort")
                self.on_output(r.stream_output())
                return True
        for r in self.running:
            if r.request_id == request_id and not r.finish_reason:
                r.fail("abort")
                return True
        return False

    def abort_all(self) -> None:
        """End every queued and running request with "abort" now (between steps): pages freed, last outputs out."""
        waiting, self.waiting = list(self.waiting), deque()
        for r in [*waiting, *self.running]:
            if not r.finish_reason:
                r.fail("abort")
        for r in waiting:
            self.on_output(r.stream_output())
        self._retire(self.running)

    def step(self) -> None:
        """Admit what fits, plan the step (prompt chunks within ``max_num_batched_tokens``, FIFO, and every
        generation request: :mod:`.scheduler`), then run it until one of its requests ends or the engine's thread
        has news; finished requests free their slot and pages before their last output goes out. A step that
        raises ends the batch's requests with "error" (pages freed, the exception in their last output) and
        re-raises."""
        batch = list(self.running)  # then the admitted ones, in admission order: prompt chunks are taken FIFO
        try:
            self._admit(batch)
            plan = plan_step(batch, self.max_num_batched_tokens, self.runner.context_lookahead)
            if plan.requests:
                self._run(plan, hold=any(r.is_context for r in batch))
        except BaseException as err:
            for r in batch:
                if not r.finish_reason:
                    r.fail("error", f"{type(err).__name__}: {err}", err)
            raise
        finally:
            self._retire(batch)

    def _retire(self, batch: list[Request]) -> None:
        """Free the finished requests' slots, then hand out their last outputs."""
        self.running = [r for r in batch if not r.finish_reason]
        for r in batch:
            if r.finish_reason:
                if r.finish_reason in ("stop", "length"):  # a whole text: cached, and suffix drafting's
                    self.prefix_cache.publish_finished(r)
                    self.runner.request_finished(r.prompt + r.output)
                if r.slot >= 0:  # not when its admission failed before it took a slot
                    self.kv.free(r.slot)
                self.on_output(r.stream_output())

    def _emit(self, batch: list[Request]) -> None:
        """Hand out each running request's new tokens (finished ones go out once their pages are free)."""
        for r in batch:
            if not r.finish_reason and len(r.output) > r.num_emitted:
                self.on_output(r.stream_output())

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

    def _new_request(self, index: int, prompt: Sequence[int], p: SamplingParams, request_id: str,
                     matcher: GrammarMatcher | None = None) -> Request:
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.runner.eos_token_ids))
        detokenizer = Detokenizer(self.decode, p.stop) if self.tokenizer is not None else None
        return Request(index, [int(t) for t in prompt], p, frozenset(stop_ids),
                       min(len(prompt) + p.max_new_tokens, self.max_seq_len), AcceptanceStats(self.max_accepted_drafts),
                       request_id, matcher=matcher, detokenizer=detokenizer, arrival=self.admission.clock())

    def idle_wait(self) -> float:
        """Seconds the engine's thread may sleep before waiting requests start (AdmissionPolicy.idle_wait)."""
        return self.admission.idle_wait(self.waiting, self.running)

    def _admit(self, batch: list[Request]) -> None:
        """Move waiting requests into ``batch`` (FIFO) while batch slots and KV pages last, once they are due
        (:class:`AdmissionPolicy`); each joins ``batch`` as it takes its slot, so a failure on the way ends it with
        the batch. A request whose prompt starts with cached pages shares them and prefills from the first page
        not cached (:mod:`.prefix_cache`)."""
        if not self.waiting or not self.admission.due(self.waiting, self.running):
            return
        later: list[Request] = []  # waiting for a page another request is prefilling (PrefixCache.waits_for_writer)
        try:
            while self.waiting and len(batch) < self.runner.max_batch_size:
                if self.prefix_cache.waits_for_writer(self.waiting[0], batch):
                    later.append(self.waiting.popleft())
                elif not self._fits():
                    break
                else:
                    batch.append(self.waiting.popleft())
                    self.prefix_cache.allocate(batch[-1], self._reserved_tokens(len(batch[-1].prompt),
                                                                                batch[-1].params))
        finally:
            self.waiting.extendleft(reversed(later))

    def _fits(self) -> bool:
        r = self.waiting[0]  # whether the pool has the pages the oldest waiting one reserves (cached ones shared)
        return self.prefix_cache.fits(r, self._reserved_tokens(len(r.prompt), r.params))

    def _run(self, plan: StepPlan, hold: bool) -> None:
        """Steps for ``plan`` until one of its requests ends or the batch must change (``hold``: after one step,
        for a request with prompt tokens to prefill; or once a waiting request is due and fits). While a graphed
        batch stays as it is, the next step is launched before the host reads this one's outputs (its inputs
        advanced on the device, :meth:`ModelRunner.run_next`), so the host's work hides behind the GPU's; a request
        that ended meanwhile has that one step's rows dropped (that step keeps the draft length it was launched
        with: under a ``draft_len_schedule`` the batch's new size takes effect one step later). A request that
        arrives meanwhile does not stop the steps ahead until it is due."""
        batch = plan.requests
        step = self._launch(plan)
        while True:
            ahead = self._launch_next(step) if self._can_run_ahead(step, hold, batch) else None
            self._complete(batch, step)
            if ahead is None:
                return
            step = ahead
            if any(r.finish_reason for r in batch):
                self._complete(batch, step)
                return

    def _can_run_ahead(self, step: LaunchedStep, hold: bool, batch: list[Request]) -> bool:
        """A generation-only batch (graphed, where there is a runner: every batch size has a bucket) that keeps
        its draft length and has no grammar, with no prompt chunk pending (``hold``), no news that needs the
        engine between steps (an abort, a call: ``should_yield``, which also takes new requests into the queue)
        and no waiting request that would join now (a free slot, admission due, KV pages for it). (A step run
        ahead for a request that has just ended writes K/V at most K + 1 positions past what the request reserved:
        into the scratch page, :attr:`ModelRunner.max_positions_per_request`.)"""
        return (not step.has_context and not hold and self.runner.can_run_next() and not self.should_yield()
                and not (self.waiting and len(batch) < self.runner.max_batch_size
                         and self.admission.due(self.waiting, batch) and self._fits()))

    def _launch(self, plan: StepPlan) -> LaunchedStep:
        """Build the step's flat inputs on the host (prompt chunks first) and launch it. Generation requests
        verify the drafts they hold (every running request holds as many: the previous step proposed them for
        all) and the step proposes the schedule's number for this batch size."""
        start = time.perf_counter()
        batch, chunks, generating = plan.requests, plan.chunks, plan.generating
        draft_len = len(generating[0].next_input) - 1 if generating else self.k
        next_draft_len = self.runner.draft_len_for(len(batch))
        ids, positions, slots = plan.flat_inputs()
        drafts = [t for r in generating for t in r.next_input[1:]]
        if self.runner.guided_decoder is not None:  # grammar masks for this step, filled before it runs
            trees = self.runner.dynamic_tree_parents([r.slot for r in generating], draft_len)
            self.runner.guided_decoder.build([r.matcher for r in batch],
                                             [[]] * len(chunks) + [r.next_input[1:] for r in generating],
                                             None if trees is None else [None] * len(chunks) + trees)
        lookahead = self.runner.context_lookahead
        packed = self.runner.step(ids, positions, slots, drafts, [r.params for r in batch],
                                  tuple(c.length for c in chunks), draft_len, next_draft_len,
                                  tuple(c.start for c in chunks), tuple(c.next_tokens(lookahead) for c in chunks))
        step = self._copy_out(packed, start, draft_len, next_draft_len, tuple(c.end for c in chunks), chained=False)
        step.prompt_tokens = sum(c.length for c in chunks)
        return step

    def _launch_next(self, step: LaunchedStep) -> LaunchedStep:
        start = time.perf_counter()
        packed = self.runner.run_next()
        return self._copy_out(packed, start, step.draft_len, step.next_draft_len, (), chained=True)

    def _copy_out(self, packed: torch.Tensor, start: float, draft_len: int, next_draft_len: int,
                  context_ends: tuple[int, ...], chained: bool) -> LaunchedStep:
        """Queue the step's one device-to-host copy (into the pinned buffer not in use) behind its kernels."""
        if not packed.is_cuda:  # a copy: a static output buffer is overwritten by the next replay
            return LaunchedStep(packed.clone(), None, draft_len, next_draft_len, context_ends, chained, start,
                                time.perf_counter() - start)
        self._buffer ^= 1
        host = self._host_buffers[self._buffer][:packed.numel()].view(packed.shape)
        host.copy_(packed, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return LaunchedStep(host, ready, draft_len, next_draft_len, context_ends, chained, start,
                            time.perf_counter() - start)

    def _complete(self, batch: list[Request], step: LaunchedStep) -> None:
        """Wait for the step's outputs and update its requests on the host (a request that has already ended
        skips its rows: they come from a step launched ahead; a partial prompt chunk only advances its cache)."""
        if step.ready is not None:
            step.ready.synchronize()
        waited = time.perf_counter()
        live = [not r.finish_reason for r in batch]
        columns = 2 * self.k + 3
        logprobs = StepLogprobs.unpack(step.host[:, columns:], self.k)
        for b, (r, row, used) in enumerate(zip(batch, step.host[:, :columns].tolist(), live)):
            if not used:
                continue
            n = row[self.k + 1]
            if b < len(step.context_ends):
                r.num_cached = step.context_ends[b]
                self.prefix_cache.publish(r)  # the step has completed: its prompt pages are written
                if r.is_context:
                    continue  # a partial prompt chunk: what the step sampled and drafted for it is discarded
            else:
                r.num_cached += n
                if step.draft_len or not self.k:  # a speculative step scheduled without drafts is not counted
                    r.stats.record(n, step.draft_len)
            r.next_input = row[self.k + 2:self.k + 3 + step.next_draft_len]
            wanted = r.params.logprobs
            r.accept(row[:n], logprobs.of(b, n, wanted) if wanted is not None else None)
        done = time.perf_counter()
        if step.has_context:
            self.admission.prefill_seconds = done - step.start
        if not step.has_context and any(live):  # a chained step's time runs from the previous step's end
            began = self._last_done if step.chained else step.start
            self.timer.record(done - began, step.host_seconds + (done - waited), sum(live))
        self._last_done = done
        if self.step_log is not None:
            self.step_log.record(step.record(done, sum(live), len(self.waiting)))
        self._emit(batch)

