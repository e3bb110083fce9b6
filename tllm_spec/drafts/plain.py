"""PlainWorker: no speculation (K = 0) through the same engine — the baseline the benchmarks compare with."""
from __future__ import annotations

import torch

from ..model.attention import AttentionMetadata
from .base import SpecWorkerBase
from .metadata import SpecMetadata


class PlainWorker(SpecWorkerBase):
    """Samples one target token per request; the output dict keeps the speculative shapes with K = 0."""

    def __init__(self, use_flashinfer: bool = True):
        super().__init__(max_draft_len=0, use_flashinfer=use_flashinfer)

    def forward(self, input_ids: torch.Tensor, target_logits: torch.Tensor, target_features: torch.Tensor,
                draft_tokens: torch.Tensor, attn: AttentionMetadata, spec_metadata: SpecMetadata
                ) -> dict[str, torch.Tensor]:
        self._execute_guided_decoder_if_present(target_logits)
        target_tokens = self.sample_target(target_logits, spec_metadata)
        new_tokens, num_accepted = self.accept_tokens(target_tokens, draft_tokens,
                                                      spec_metadata.num_context_requests, spec_metadata)
        return {"new_tokens": new_tokens, "new_tokens_lens": num_accepted,
                "next_draft_tokens": draft_tokens.new_zeros(new_tokens.shape[0], 0), "next_new_tokens": new_tokens}
