"""SpecMetadata: the per-step sampling rows of the flat layout, in device tensors with stable addresses."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .config import SamplingParams


class SpecMetadata:
    """Sampling parameters and gather ids for one step, in the flat row layout.

    Rows: one per context request (its last prompt token), then ``K + 1`` per generation request.
    Buffers are allocated once for ``max_num_requests`` and refilled in place by :meth:`prepare`, so a
    captured CUDA graph keeps reading the right memory. Greedy requests get ``T = 1, top_k = 1, top_p = 1``
    (the sampler returns their exact argmax); disabled top-k is the vocabulary size, disabled top-p is 1.
    ``all_greedy`` is set by :meth:`prepare` on the host from the SamplingParams (no device read): the workers
    then take a plain argmax instead of sampling.
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
        self.num_context_requests = 0
        self.num_generation_requests = 0
        self.all_greedy = True

    @property
    def num_rows(self) -> int:
        return self.num_context_requests + self.num_generation_requests * (self.max_draft_len + 1)

    def reseed(self, seed: int) -> None:
        self.seed.fill_(seed % 2**31)
        self.offset.zero_()

    def prepare(self, params: Sequence[SamplingParams], context_lens: Sequence[int]) -> None:
        """Fill the rows for ``params`` (context requests first, ``len(context_lens)`` of them).

        context_lens: prompt tokens of each context request this step (their tokens come first in the flat
        token layout, generation requests' K+1 tokens after).
        """
        num_ctx, rows_per_gen = len(context_lens), self.max_draft_len + 1
        self.num_context_requests, self.num_generation_requests = num_ctx, len(params) - num_ctx
        self.all_greedy = all(p.is_greedy for p in params)
        repeats = [1] * num_ctx + [rows_per_gen] * self.num_generation_requests
        temps, top_ks, top_ps = [], [], []
        for p, rep in zip(params, repeats):
            temp, top_k, top_p = _row_values(p, self.vocab_size)
            temps += [temp] * rep
            top_ks += [top_k] * rep
            top_ps += [top_p] * rep
        ends_ctx = torch.tensor(context_lens, dtype=torch.int64).cumsum(0) - 1
        gen_start = int(sum(context_lens))
        gen_ids = torch.arange(gen_start, gen_start + self.num_generation_requests * rows_per_gen)
        rows = self.num_rows
        self.temperatures[:rows].copy_(torch.tensor(temps, dtype=torch.float32), non_blocking=True)
        self.top_ks[:rows].copy_(torch.tensor(top_ks, dtype=torch.int32), non_blocking=True)
        self.top_ps[:rows].copy_(torch.tensor(top_ps, dtype=torch.float32), non_blocking=True)
        self.gather_ids[:rows].copy_(torch.cat([ends_ctx, gen_ids]), non_blocking=True)

    def first_rows(self) -> torch.Tensor:
        """Index of each request's first row (context: its only row; generation: its K+1 block). [B] int64."""
        num_ctx, num_gen = self.num_context_requests, self.num_generation_requests
        device = self.gather_ids.device
        gen = num_ctx + torch.arange(num_gen, device=device) * (self.max_draft_len + 1)
        return torch.cat([torch.arange(num_ctx, device=device), gen])

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views (temperatures, top_ks, top_ps) over this step's rows."""
        rows = self.num_rows
        return self.temperatures[:rows], self.top_ks[:rows], self.top_ps[:rows]


def _row_values(p: SamplingParams, vocab_size: int) -> tuple[float, int, float]:
    if p.is_greedy:
        return 1.0, 1, 1.0
    top_k = vocab_size if p.top_k == 0 else min(p.top_k, vocab_size)
    return p.temperature, top_k, p.top_p
