"""Logprobs of the emitted tokens (OpenAI / vLLM ``logprobs``): computed inside the step only when a request of the
batch asks for them, carried out of it in the packed outputs, decoded on the host.

The distribution is the target's: ``log_softmax(logits)`` in fp32 at the row that produced the token (in a tree
step the row of its accepted path's node), before temperature, top-k and top-p (vLLM's default "raw" logprobs) and
after a grammar's mask (applied to the logits in place before anything reads them, as vLLM applies its bitmask).
Speculation does not change it: an emitted token's row is the target row that verified it. A step computes ``width`` top entries per row, the batch's largest N rounded
up to one of :data:`LOGPROBS_WIDTHS`, so that CUDA graphs and compilations stay few.

Packing (after the 2K+3 token columns): the chosen tokens' logprobs, K+1 columns of fp32 bits; then (K+1)*W
columns ``token id << 32 | fp32 bits`` of each position's top entries, best first.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOGPROBS_WIDTHS = (1, 5, 20)  # top entries a step computes: the batch's largest N, rounded up
MAX_LOGPROBS = LOGPROBS_WIDTHS[-1]
_LOW_BITS = 0xFFFFFFFF


def logprobs_width(requested: Sequence[int | None]) -> int:
    """Top entries per row a step computes for requests asking ``requested`` (None: off); 0 if none asks."""
    asked = [n for n in requested if n is not None]
    return next(w for w in LOGPROBS_WIDTHS if w >= max(asked)) if asked else 0


def logprobs_columns(max_draft_len: int, width: int) -> int:
    """Packed columns of a step's logprobs at ``width`` (0 when off)."""
    return (max_draft_len + 1) * (1 + width) if width else 0


def token_logprobs(logits: torch.Tensor, new_tokens: torch.Tensor, num_contexts: int, width: int,
                   rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The emitted tokens' logprobs and the ``width`` most likely tokens at their rows.

    logits [R, V] in the flat row layout; new_tokens [B, k+1] int64; rows [B, k+1] int64: the row that produced
    each column (default: a chain's, a context request's token from its one row and column j of generation
    request g from row num_contexts + g(k+1) + j; a tree's: the nodes of its accepted path). Returns
    token_logprobs [B, k+1] f32, top_logprob_ids [B, k+1, W] int64 and top_logprobs [B, k+1, W] f32 (W =
    min(width, V), best first); a context request's columns past its first are zeros."""
    if rows is None:
        rows = chain_rows(num_contexts, new_tokens.shape[0] - num_contexts, new_tokens.shape[1], logits.device)
    logits = logits.float()
    normalizer = torch.logsumexp(logits, -1, keepdim=True)  # [R, 1]: log_softmax = logits - normalizer
    top_values, top_ids = logits.topk(min(width, logits.shape[-1]), dim=-1)  # [R, W] sorted
    chosen = logits[rows, new_tokens] - normalizer[rows, 0]  # [B, k+1] (no copy of whole rows)
    kept = torch.ones_like(new_tokens, dtype=torch.bool)
    kept[:num_contexts, 1:] = False  # a context request emits one token
    return {"token_logprobs": torch.where(kept, chosen, 0.0),
            "top_logprob_ids": torch.where(kept[..., None], top_ids[rows], 0),
            "top_logprobs": torch.where(kept[..., None], (top_values - normalizer)[rows], 0.0)}


def chain_rows(num_contexts: int, num_generation: int, tokens_per_request: int, device: torch.device | str
               ) -> torch.Tensor:
    """[B, k+1]: the flat logits row of each emitted column in a chain step (a context request's one row for all
    its columns)."""
    context = torch.arange(num_contexts, device=device)[:, None].expand(-1, tokens_per_request)
    generation = num_contexts + torch.arange(num_generation * tokens_per_request, device=device)
    return torch.cat([context, generation.view(num_generation, tokens_per_request)])


def pack_logprobs(out: dict[str, torch.Tensor], max_draft_len: int) -> torch.Tensor:
    """token_logprobs [B, k+1], top_logprob_ids / top_logprobs [B, k+1, W] -> [B, (K+1)(1+W)] int64 (positions
    past k+1 zero-padded)."""
    pad = max_draft_len + 1 - out["token_logprobs"].shape[1]
    chosen = F.pad(_bits(out["token_logprobs"]), (0, pad))  # [B, K+1]
    top = (out["top_logprob_ids"] << 32) | _bits(out["top_logprobs"])  # [B, k+1, W]
    return torch.cat([chosen, F.pad(top, (0, 0, 0, pad)).flatten(1)], dim=1)


def _bits(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> its 32 bits in the low half of an int64."""
    return values.contiguous().view(torch.int32).to(torch.int64) & _LOW_BITS


def _floats(packed: torch.Tensor) -> torch.Tensor:
    """The fp32 in the low 32 bits of each int64 (the inverse of :func:`_bits`)."""
    low = packed & _LOW_BITS
    return torch.where(low > 0x7FFFFFFF, low - (1 << 32), low).to(torch.int32).view(torch.float32)


@dataclass
class StepLogprobs:
    """One step's logprobs on the host, per request and token position (K+1 positions, W top entries)."""

    chosen: list[list[float]]  # [B][K+1]
    top_ids: list[list[list[int]]]  # [B][K+1][W]
    top_values: list[list[list[float]]]  # [B][K+1][W]

    @classmethod
    def unpack(cls, columns: torch.Tensor, max_draft_len: int) -> StepLogprobs | None:
        """The logprob columns of a step's packed outputs [B, (K+1)(1+W)] int64 on the host; None if empty."""
        if columns.shape[1] == 0:
            return None
        k1 = max_draft_len + 1
        top = columns[:, k1:].reshape(columns.shape[0], k1, -1)  # [B, K+1, W]
        return cls(_floats(columns[:, :k1]).tolist(), (top >> 32).tolist(), _floats(top).tolist())

    def of(self, index: int, num_tokens: int, num_top: int) -> tuple[list[float], list[dict[int, float]]]:
        """Request ``index``'s first ``num_tokens`` positions: (logprobs, top ``num_top`` {token id: logprob})."""
        top = [dict(zip(ids[:num_top], values[:num_top]))
               for ids, values in zip(self.top_ids[index][:num_tokens], self.top_values[index][:num_tokens])]
        return self.chosen[index][:num_tokens], top
