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
from .sampling.logprobs import logprobs_columns, pack_logprobs, token_logprobs


class OneModel(nn.Module):
    """Target + worker. ``spec_metadata`` holds the step's sampling rows and gather ids in static device
    buffers (filled by the runner before each step)."""

    def __init__(self, target: TargetModel, worker: SpecWorkerBase, mode: SpeculativeDecodingMode,
                 spec_metadata: SpecMetadata):
        super().__init__()
        self.target, self.worker, self.mode, self.spec_metadata = target, worker, mode, spec_metadata
        # the draft reads the capture layers' features (EAGLE-3), else the final hidden state; a bool, which the
        # compiled step's guards keep across processes (an enum member is guarded by identity: trace_cache)
        self.drafts_from_captured = mode.is_eagle3_one_model()

    @property
    def max_draft_len(self) -> int:
        return self.worker.max_draft_len

    @property
    def device(self) -> torch.device:
        return self.target.lm_head.weight.device

    def bind_kv_cache(self, kv_cache) -> None:
        """Point the fused target's attention and the drafter at ``kv_cache`` (another engine over the same target
        may have pointed them at its own)."""
        if self.target.fused is not None:
            self.target.fused.bind_kv_cache(kv_cache)
        self.worker.bind_kv_cache(kv_cache)

    def forward(self, input_ids: torch.Tensor, attn: AttentionMetadata, draft_tokens: torch.Tensor
                ) -> dict[str, torch.Tensor]:
        """One step: target over the packed batch -> logits at gather ids -> worker (sample, accept, draft).

        input_ids [T] int64 in the flat layout; draft_tokens [G, k] int64 (the drafts being verified, k =
        spec_metadata.draft_len). Returns new_tokens [B, k+1], new_tokens_lens [B], next_draft_tokens [B, k'],
        next_new_tokens [B, k'+1] (k' = spec_metadata.next_draft_len); when a request asks for logprobs
        (spec_metadata.logprobs_width > 0, known on the host) also token_logprobs [B, k+1] f32, top_logprob_ids
        [B, k+1, W] int64 and top_logprobs [B, k+1, W] f32 (sampling/logprobs.py).
        """
        metadata = self.spec_metadata
        hidden, captured = self.target(input_ids, attn)
        metadata.record_positions(attn.positions)
        logits = self.target.compute_logits(hidden[metadata.gather_ids[:metadata.num_rows]])
        features = captured if self.drafts_from_captured else hidden
        out = self.worker(input_ids, logits, features, draft_tokens, attn, metadata)
        rows = out.pop("emitted_rows", None)  # a tree step's: the accepted path's rows
        if metadata.logprobs_width:  # the logits as the worker read them (a grammar masks them in place)
            out.update(token_logprobs(logits, out["new_tokens"], metadata.num_context_requests,
                                      metadata.logprobs_width, rows))
        return out

    def packed_forward(self, input_ids: torch.Tensor, attn: AttentionMetadata, draft_tokens: torch.Tensor
                       ) -> torch.Tensor:
        """:meth:`forward` with its outputs packed [B, 2K+3 (+ logprob columns)] int64 (one D2H copy; K =
        max_draft_len, shorter steps padded; :func:`pack_outputs`). Tensor parallel: rank 0's outputs on every rank
        (every rank computes the same tokens from the same gathered logits and seeds; the broadcast makes the host
        schedules of the ranks identical by construction)."""
        packed = pack_outputs(self(input_ids, attn, draft_tokens), self.max_draft_len)
        parallel = self.target.parallel
        return packed if parallel is None else broadcast_from_first(packed, parallel)


def pack_outputs(out: dict[str, torch.Tensor], max_draft_len: int) -> torch.Tensor:
    """new_tokens [B, k+1] | new_tokens_lens [B, 1] | next_new_tokens [B, k'+1], each token block zero-padded
    to K+1 columns (K = max_draft_len) -> [B, 2K+3] int64 (one D2H copy); a step with logprobs appends their
    (K+1)(1+W) columns (:func:`tllm_spec.sampling.logprobs.pack_logprobs`)."""
    def padded(tokens: torch.Tensor) -> torch.Tensor:
        return F.pad(tokens, (0, max_draft_len + 1 - tokens.shape[1]))
    blocks = [padded(out["new_tokens"]), out["new_tokens_lens"][:, None], padded(out["next_new_tokens"])]
    if "token_logprobs" in out:
        blocks.append(pack_logprobs(out, max_draft_len))
    return torch.cat(blocks, dim=1)


def packed_columns(max_draft_len: int, logprobs_width: int = 0) -> int:
    """Columns of the packed outputs: 2K+3, plus the logprobs' at ``logprobs_width`` top entries (0: none)."""
    return 2 * max_draft_len + 3 + logprobs_columns(max_draft_len, logprobs_width)
