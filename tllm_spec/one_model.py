"""OneModel: the one-model step as a pure nn.Module — the target's forward, then the speculative worker (sample,
accept, draft) inside the same call, so the whole step can be one CUDA graph."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .distributed.parallel import broadcast_from_first
from .drafts.base import SpecWorkerBase
from .drafts.metadata import SpecMetadata
from .model.attention import AttentionMetadata
from .model.target import TargetModel
from .modes import SpeculativeDecodingMode


class OneModel(nn.Module):
    """Target + worker. ``spec_metadata`` holds the step's sampling rows and gather ids in static device
    buffers (filled by the runner before each step)."""

    def __init__(self, target: TargetModel, worker: SpecWorkerBase, mode: SpeculativeDecodingMode,
                 spec_metadata: SpecMetadata):
        super().__init__()
        self.target, self.worker, self.mode, self.spec_metadata = target, worker, mode, spec_metadata

    @property
    def max_draft_len(self) -> int:
        return self.worker.max_draft_len

    @property
    def device(self) -> torch.device:
        return self.target.lm_head.weight.device

    def forward(self, input_ids: torch.Tensor, attn: AttentionMetadata, draft_tokens: torch.Tensor
                ) -> dict[str, torch.Tensor]:
        """One step: target over the packed batch -> logits at gather ids -> worker (sample, accept, draft).

        input_ids [T] int64 in the flat layout; draft_tokens [G, k] int64 (the drafts being verified, k =
        spec_metadata.draft_len). Returns new_tokens [B, k+1], new_tokens_lens [B], next_draft_tokens [B, k'],
        next_new_tokens [B, k'+1] (k' = spec_metadata.next_draft_len).
        """
        hidden, captured = self.target(input_ids, attn)
        self.spec_metadata.record_positions(attn.positions)
        logits = self.target.compute_logits(hidden[self.spec_metadata.gather_ids[:self.spec_metadata.num_rows]])
        features = captured if self.mode.is_eagle3_one_model() else hidden
        return self.worker(input_ids, logits, features, draft_tokens, attn, self.spec_metadata)

    def packed_forward(self, input_ids: torch.Tensor, attn: AttentionMetadata, draft_tokens: torch.Tensor
                       ) -> torch.Tensor:
        """:meth:`forward` with its outputs packed [B, 2K+3] int64 (one D2H copy; K = max_draft_len, shorter
        steps padded). Tensor parallel: rank 0's outputs on every rank (every rank computes the same tokens from
        the same gathered logits and seeds; the broadcast makes the host schedules of the ranks identical by
        construction)."""
        packed = pack_outputs(self(input_ids, attn, draft_tokens), self.max_draft_len)
        parallel = self.target.parallel
        return packed if parallel is None else broadcast_from_first(packed, parallel)


def pack_outputs(out: dict[str, torch.Tensor], max_draft_len: int) -> torch.Tensor:
    """new_tokens [B, k+1] | new_tokens_lens [B, 1] | next_new_tokens [B, k'+1], each token block zero-padded
    to K+1 columns (K = max_draft_len) -> [B, 2K+3] int64 (one D2H copy)."""
    def padded(tokens: torch.Tensor) -> torch.Tensor:
        return F.pad(tokens, (0, max_draft_len + 1 - tokens.shape[1]))
    return torch.cat([padded(out["new_tokens"]), out["new_tokens_lens"][:, None], padded(out["next_new_tokens"])],
                     dim=1)
