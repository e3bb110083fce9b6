"""SAWorker: drafts copied from each request's own text (TensorRT-LLM ``SpeculativeDecodingMode.SA``)."""
from __future__ import annotations

import torch

from ...config import SAConfig
from ...model.attention import AttentionMetadata
from ...model.target import TargetModel
from ..base import SpecWorkerBase
from ..metadata import SpecMetadata
from .enhancer import SADraftEnhancer


class SAWorker(SpecWorkerBase):
    """No draft model: after acceptance each request's text grows by its accepted tokens, and its next K drafts
    continue the longest suffix of that text that occurred before. A request without such a match verifies no
    drafts (its K rows run, their acceptance is masked), so its step emits the target's one token.

    Worked trace, K = 3, prompt ``a b c a b``:

    * step 1 (context): the target samples ``c``; the text ``a b c a b c`` ends with ``a b c``, which occurred at
      positions 0-2, so the drafts are what followed there, ``a b c`` (period 3). next_new_tokens ``[c a b c]``.
    * step 2: the target verifies ``c a b c`` and samples ``a b d x``: ``a b`` accepted, ``d`` the correction.
      The text ``... c a b d`` has no earlier ``d``: no match, so the next step verifies no drafts.

    Sampled requests keep strict acceptance: a deterministic draft is accepted when the target's own sample equals
    it, exactly what rejection sampling would do with a one-hot draft distribution (accept with probability p).
    """

    def __init__(self, max_draft_len: int, enhancer: SADraftEnhancer, use_flashinfer: bool = True):
        super().__init__(max_draft_len, use_flashinfer)
        self.sa = enhancer

    def allocate_state(self, num_slots: int, vocab_size: int, device: torch.device, max_positions: int = 0) -> None:
        super().allocate_state(num_slots, vocab_size, device, max_positions)
        self.sa.allocate(num_slots, max_positions, device)
        self.has_drafts = torch.zeros(num_slots, dtype=torch.bool, device=device)  # [slots]: drafts from a match

    def request_finished(self, token_ids: list[int]) -> None:
        self.sa.request_finished(token_ids)

    def prefix_reused(self, slot: int, tokens: list[int]) -> None:
        self.sa.prefix_reused(slot, tokens)

    def forward(self, input_ids: torch.Tensor, target_logits: torch.Tensor, target_features: torch.Tensor,
                draft_tokens: torch.Tensor, attn: AttentionMetadata, spec_metadata: SpecMetadata
                ) -> dict[str, torch.Tensor]:
        """input_ids [T]; target_logits [R, V]; draft_tokens [G, k] being verified (a request without a match's are
        masked). Returns the TensorRT-LLM output dict."""
        num_ctx = spec_metadata.num_context_requests
        slots = attn.token_slots[spec_metadata.gather_ids[spec_metadata.first_rows()]]  # [B]
        self._execute_guided_decoder_if_present(target_logits)
        target_tokens = self.sample_target(target_logits, spec_metadata)
        verified = torch.where(self.has_drafts[slots[num_ctx:], None], draft_tokens, -1)  # -1 equals no token
        new_tokens, num_accepted = self.accept_tokens(target_tokens, verified, num_ctx, spec_metadata)
        self._add_guided_draft_batch_if_present(num_accepted)
        self.sa.observe(input_ids, new_tokens, num_accepted, attn, spec_metadata, slots)
        next_draft_tokens, found = self.sa.propose(slots, spec_metadata.next_draft_len)
        self.has_drafts[slots] = found
        return {
            "new_tokens": new_tokens,
            "new_tokens_lens": num_accepted,
            "next_draft_tokens": next_draft_tokens,
            "next_new_tokens": self._prepare_next_new_tokens(new_tokens, num_accepted, next_draft_tokens),
        }


def build_sa_worker(target: TargetModel, cfg: SAConfig, max_batch_size: int) -> SAWorker:
    """The worker for ``cfg`` (``target`` and ``max_batch_size`` unused: the state is sized by the runner's
    ``allocate_state``; the same signature as the other build functions)."""
    pool_size = cfg.global_pool_size if cfg.enable_global_pool else None
    return SAWorker(cfg.max_draft_len, SADraftEnhancer(1, cfg.max_matching_ngram_size, pool_size))
