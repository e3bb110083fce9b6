"""SpecMetadata: the per-step sampling rows of the flat layout, in device tensors with stable addresses."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import SamplingParams
from ..sampling import rng
from ..sampling.logprobs import logprobs_width


def sampling_variant(params: Sequence[SamplingParams]) -> tuple[bool, bool, int]:
    """(all greedy, some sampled request has its own seed, logprobs width): the host-side facts that pick a step's
    sampling code (argmax only / batch-stream sampler / per-row streams on the torch sampler) and whether it
    computes logprobs (0: no request asks; else the top entries per row, the largest N rounded up)."""
    sampled = [p for p in params if not p.is_greedy]
    return not sampled, any(p.seed is not None for p in sampled), logprobs_width([p.logprobs for p in params])


class SpecMetadata:
    """Sampling parameters and gather ids for one step, in the flat row layout.

    Rows: one per context request (its last prompt token), then ``k + 1`` per generation request, k =
    ``draft_len`` the drafts each generation request verifies this step (``max_draft_len``, or less under a
    draft-length schedule); the step proposes ``next_draft_len`` drafts per request.
    Buffers are allocated once for ``max_num_requests`` and refilled in place by :meth:`prepare`, so a
    captured CUDA graph keeps reading the right memory. Greedy requests get ``T = 1, top_k = 1, top_p = 1``
    (the sampler returns their exact argmax); disabled top-k is the vocabulary size, disabled top-p is 1.

    Random streams: rows draw from the batch stream (``seed``, ``offset``: advanced in place after every
    draw) unless their request has ``SamplingParams.seed``. Such a row draws from its own stream keyed by
    (request seed, counter); the counter is ``L0 * (K+1) + j`` (K = max_draft_len), L0 the position of the
    request's first token in the step (strictly increasing from step to step) and j the row (or draft step)
    within the request — nothing that depends on the rest of the batch (unless a draft-length schedule is set:
    the batch size then picks how many drafts a step has, and so which draws a request makes). The host-side
    flags ``all_greedy``, ``has_request_seeds`` and ``logprobs_width`` are set by :meth:`prepare` from the
    SamplingParams, without reading the device.

    Chunked prefill (:meth:`prepare_chunks`): a context request's tokens may be a chunk of its prompt. A chunk that
    stops before the prompt's end is *partial*: its row is sampled and the engine discards the token, and the
    draft pairs the chunk's last positions with the prompt tokens after it (``context_next_tokens``), not with
    sampled ones. A chunk that starts past position 0 *continues* its prompt (state such as relaxed acceptance's
    thinking flag carries over from the chunks before it).
    """

    def __init__(self, max_num_requests: int, max_draft_len: int, vocab_size: int, device: torch.device | str):
        self.max_draft_len = max_draft_len
        self.vocab_size = vocab_size
        max_rows = max_num_requests * (max_draft_len + 1)
        self.temperatures = torch.ones(max_rows, dtype=torch.float32, device=device)  # [R] f32
        self.top_ks = torch.ones(max_rows, dtype=torch.int32, device=device)  # [R] int32
        self.top_ps = torch.ones(max_rows, dtype=torch.float32, device=device)  # [R] f32
        self.gather_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)  # [R] int64 flat token index
        self.seed = torch.zeros(1, dtype=torch.int64, device=device)  # [1] int64, advanced in place
        self.offset = torch.zeros(1, dtype=torch.int64, device=device)  # [1] int64
        self.seed_per_row = torch.zeros(max_rows, dtype=torch.int64, device=device)  # [R] request seed, 0 if none
        self.seeded_rows = torch.zeros(max_rows, dtype=torch.bool, device=device)  # [R] request has a seed
        self.row_positions = torch.zeros(max_rows, dtype=torch.int64, device=device)  # [R] token position per row
        # [C, max(1, K)] int64: the prompt tokens after each partial context chunk (the draft's lookahead)
        self.context_next_tokens = torch.zeros(max_num_requests, max(1, max_draft_len), dtype=torch.int64,
                                               device=device)
        self.partial_contexts = torch.zeros(max_num_requests, dtype=torch.bool, device=device)  # [C] bool
        self.continued_contexts = torch.zeros(max_num_requests, dtype=torch.bool, device=device)  # [C] bool
        self.has_partial_contexts = self.has_continued_contexts = False  # host flags of the prepared step
        self.num_context_requests = 0
        self.num_generation_requests = 0
        self.draft_len = self.next_draft_len = max_draft_len
        # TensorRT-LLM's tree fields, with a chain's values (the step drafts chains: drafts/tree.py verifies trees)
        self.max_total_draft_tokens = max_draft_len
        self.is_spec_dec_tree = self.is_spec_dec_dynamic_tree = False
        self._prepared: tuple[list[SamplingParams], tuple[int, ...]] = ([], ())  # what the rows hold now
        self.all_greedy = True
        self.has_request_seeds = False
        self.logprobs_width = 0  # top logprobs per row the step computes; 0: no logprobs

    @property
    def num_rows(self) -> int:
        return self.num_context_requests + self.num_generation_requests * (self.draft_len + 1)

    @property
    def variant(self) -> tuple[bool, bool, int]:
        """(all_greedy, has_request_seeds, logprobs_width) of the prepared step: what a captured CUDA graph is
        keyed by (with its batch bucket and draft lengths)."""
        return self.all_greedy, self.has_request_seeds, self.logprobs_width

    def reseed(self, seed: int) -> None:
        self.seed.fill_(seed % 2**31)
        self.offset.zero_()

    def prepare(self, params: Sequence[SamplingParams], context_lens: Sequence[int], draft_len: int | None = None,
                next_draft_len: int | None = None) -> None:
        """Fill the rows for ``params`` (context requests first, ``len(context_lens)`` of them).

        context_lens: prompt tokens of each context request this step (their tokens come first in the flat
        token layout, generation requests' draft_len + 1 tokens after). draft_len: drafts each generation
        request verifies; next_draft_len: drafts the step proposes (both default max_draft_len).
        """
        draft_len = self.max_draft_len if draft_len is None else draft_len
        self.next_draft_len = self.max_draft_len if next_draft_len is None else next_draft_len
        self.has_partial_contexts = self.has_continued_contexts = False  # whole prompts unless prepare_chunks
        if self._holds(params, context_lens, draft_len):
            return  # a steady batch: the rows are already there (no host work, no copies)
        self._prepared = (list(params), tuple(context_lens))
        self.draft_len = draft_len
        num_ctx, rows_per_gen = len(context_lens), draft_len + 1
        self.num_context_requests, self.num_generation_requests = num_ctx, len(params) - num_ctx
        self.all_greedy, self.has_request_seeds, self.logprobs_width = sampling_variant(params)
        repeats = torch.tensor([1] * num_ctx + [rows_per_gen] * self.num_generation_requests, dtype=torch.int64)
        columns = list(zip(*(_row_values(p, self.vocab_size) for p in params))) or [()] * len(_ROW_DTYPES)
        temps, top_ks, top_ps, seeds, seeded = (torch.tensor(c, dtype=dtype).repeat_interleave(repeats)
                                                for c, dtype in zip(columns, _ROW_DTYPES))
        ends_ctx = torch.tensor(context_lens, dtype=torch.int64).cumsum(0) - 1
        gen_start = int(sum(context_lens))
        gen_ids = torch.arange(gen_start, gen_start + self.num_generation_requests * rows_per_gen)
        rows = self.num_rows
        self.temperatures[:rows].copy_(temps, non_blocking=True)
        self.top_ks[:rows].copy_(top_ks, non_blocking=True)
        self.top_ps[:rows].copy_(top_ps, non_blocking=True)
        self.gather_ids[:rows].copy_(torch.cat([ends_ctx, gen_ids]), non_blocking=True)
        if self.has_request_seeds:
            self.seed_per_row[:rows].copy_(seeds, non_blocking=True)
            self.seeded_rows[:rows].copy_(seeded, non_blocking=True)

    def prepare_chunks(self, starts: Sequence[int], next_tokens: Sequence[Sequence[int]]) -> None:
        """After :meth:`prepare`: where each context request's chunk starts (its first position; empty: all 0)
        and the prompt tokens right after it (at least the draft's lookahead; empty: the chunk ends its
        prompt). Copies to the device only when some chunk is partial / continued."""
        num_ctx = self.num_context_requests
        self.has_partial_contexts = any(len(t) > 0 for t in next_tokens)
        self.has_continued_contexts = any(s > 0 for s in starts)
        if self.has_partial_contexts:
            width = self.context_next_tokens.shape[1]
            rows = [list(t[:width]) + [0] * (width - len(t[:width])) for t in next_tokens]
            self.context_next_tokens[:num_ctx].copy_(torch.tensor(rows, dtype=torch.int64), non_blocking=True)
            self.partial_contexts[:num_ctx].copy_(torch.tensor([len(t) > 0 for t in next_tokens]),
                                                  non_blocking=True)
        if self.has_continued_contexts:
            self.continued_contexts[:num_ctx].copy_(torch.tensor([s > 0 for s in starts]), non_blocking=True)

    def with_next_prompt_tokens(self, tokens: torch.Tensor, column: int) -> torch.Tensor:
        """``tokens`` with each partial context's entry replaced by the prompt token ``column + 1`` places after
        its chunk's last token (column 0: the next one). tokens [N] int64, one per request or row, context
        requests first (N >= C) -> [N]. Unchanged (no op) when no chunk is partial."""
        if not self.has_partial_contexts:
            return tokens
        num_ctx = self.num_context_requests
        ctx = torch.where(self.partial_contexts[:num_ctx], self.context_next_tokens[:num_ctx, column], tokens[:num_ctx])
        return torch.cat([ctx, tokens[num_ctx:]])

    def bind_generation_requests(self, drafts: torch.Tensor) -> None:
        """Take a generation-only step's request count from its drafts' shape [G, k] (the number :meth:`prepare`
        set): traced by torch.compile, the batch size then stays symbolic instead of a constant per bucket."""
        if not torch.compiler.is_compiling() and (self.num_context_requests or
                                                  drafts.shape[0] != self.num_generation_requests):
            raise ValueError(f"a generation step of {drafts.shape[0]} requests, but the rows were prepared for "
                             f"{self.num_context_requests} context and {self.num_generation_requests} generation "
                             "requests")
        self.num_generation_requests = drafts.shape[0]

    def _holds(self, params: Sequence[SamplingParams], context_lens: Sequence[int], draft_len: int) -> bool:
        held, held_lens = self._prepared
        return (tuple(context_lens) == held_lens and draft_len == self.draft_len and len(params) == len(held)
                and all(a is b for a, b in zip(params, held)))

    def first_rows(self) -> torch.Tensor:
        """Index of each request's first row (context: its only row; generation: its k+1 block). [B] int64."""
        num_ctx, num_gen = self.num_context_requests, self.num_generation_requests
        device = self.gather_ids.device
        gen = num_ctx + torch.arange(num_gen, device=device) * (self.draft_len + 1)
        return torch.cat([torch.arange(num_ctx, device=device), gen])

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views (temperatures, top_ks, top_ps) over this step's rows."""
        rows = self.num_rows
        return self.temperatures[:rows], self.top_ks[:rows], self.top_ps[:rows]

    def record_positions(self, positions: torch.Tensor) -> None:
        """Keep each row's token position, the counter of per-request streams. positions [T] int64 (the
        step's flat token positions). Only steps with request seeds need it."""
        if self.has_request_seeds:
            rows = self.num_rows
            self.row_positions[:rows].copy_(positions[self.gather_ids[:rows]])

    def target_streams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(seed, offset) for one draw over this step's R rows: the batch stream ([1], [1]; the sampler
        advances it) when no request has a seed, else per row ([R], [R]; the batch stream advanced here)."""
        if not self.has_request_seeds:
            return self.seed, self.offset
        rows = self.num_rows
        device = self.row_positions.device
        gen_rows = torch.arange(rows - self.num_context_requests, device=device) % (self.draft_len + 1)
        within = torch.cat([torch.zeros(self.num_context_requests, dtype=torch.int64, device=device), gen_rows])
        step_start = self.row_positions[:rows] - within  # L0 of the row's request
        return self._row_streams(torch.arange(rows, device=device), step_start * (self.max_draft_len + 1) + within)

    def draft_streams(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(seed, offset) for draft step ``step``, one row per request ([1] or [B]; as :meth:`target_streams`)."""
        if not self.has_request_seeds:
            return self.seed, self.offset
        first = self.first_rows()
        return self._row_streams(first, self.row_positions[first] * (self.max_draft_len + 1) + step)

    def generation_streams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(seed, offset) for the rejection sampler, one row per generation request ([1] or [G])."""
        if not self.has_request_seeds:
            return self.seed, self.offset
        first = self.first_rows()[self.num_context_requests:]
        return self._row_streams(first, self.row_positions[first] * (self.max_draft_len + 1))

    def _row_streams(self, rows: torch.Tensor, counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Seeded rows: (request seed, counter); the others: (batch seed, -1 - index), a stream apart from any
        counter. Then the batch stream moves on, as after any draw from it. rows, counters [N] -> [N], [N]."""
        seeded = self.seeded_rows[rows]
        seed = torch.where(seeded, self.seed_per_row[rows], self.seed)
        batch_offset = self.offset - 1 - torch.arange(rows.shape[0], device=rows.device)
        offset = torch.where(seeded, counters, batch_offset)
        rng.advance(self.seed)
        return seed, offset


_ROW_DTYPES = (torch.float32, torch.int32, torch.float32, torch.int64, torch.bool)


def _row_values(p: SamplingParams, vocab_size: int) -> tuple[float, int, float, int, bool]:
    """(temperature, top_k, top_p, seed, has a seed) of one request's rows; greedy rows need no seed."""
    if p.is_greedy:
        return 1.0, 1, 1.0, 0, False
    top_k = vocab_size if p.top_k == 0 else min(p.top_k, vocab_size)
    return p.temperature, top_k, p.top_p, p.seed or 0, p.seed is not None
