"""SADraftEnhancer: each request's suffix-match state, fed the step's prompt chunks and accepted tokens, and the
rule that lets its drafts replace a head's (TensorRT-LLM ``use_sa_spec`` / ``sa_spec_threshold``)."""
from __future__ import annotations

import torch
from torch import nn

from ...model.attention import AttentionMetadata
from ..metadata import SpecMetadata
from .global_pool import GlobalPool
from .suffix_match import SuffixMatch


class SADraftEnhancer(nn.Module):
    """Per request (KV slot) its text so far and where its suffix occurred before (:class:`SuffixMatch`).

    :meth:`observe` runs after a step's acceptance: a context request's chunk starts (or continues) its text and
    its sampled token follows unless the chunk is partial; a generation request appends its accepted tokens.
    :meth:`propose` then drafts k tokens per request from the text; :meth:`override` replaces a head's drafts
    where the match is at least ``threshold`` tokens long (all k of them, as TensorRT-LLM's
    ``SADraftEnhancer.maybe_override_all_draft_tokens``). Device tensors only, but for the context chunks' host
    sizes: a generation step stays one graph."""

    def __init__(self, threshold: int = 1, max_matching_ngram_size: int = -1, global_pool_size: int | None = None):
        super().__init__()
        self.threshold, self.max_matching_ngram_size = threshold, max_matching_ngram_size
        self.global_pool_size = global_pool_size  # None: each request drafts from its own text only
        self.state: SuffixMatch | None = None  # allocate()
        self.pool: GlobalPool | None = None

    def allocate(self, num_slots: int, max_positions: int, device: torch.device) -> None:
        self.state = SuffixMatch(num_slots, max_positions, self.max_matching_ngram_size).to(device)
        if self.global_pool_size is not None:
            self.pool = GlobalPool(num_slots, self.global_pool_size, self.state.min_match).to(device)

    def prefix_reused(self, slot: int, tokens: list[int]) -> None:
        """A prompt's first tokens came from the prefix cache: they start the slot's text."""
        self.state.prefill(slot, tokens)

    def request_finished(self, token_ids: list[int]) -> None:
        """A finished request's prompt and output join the global pool (when there is one)."""
        if self.pool is not None:
            self.pool.add(token_ids, self.state)

    def observe(self, input_ids: torch.Tensor, new_tokens: torch.Tensor, num_accepted: torch.Tensor,
                attn: AttentionMetadata, spec_metadata: SpecMetadata, slots: torch.Tensor) -> None:
        """input_ids [T] (context chunks first); new_tokens [B, k+1] and num_accepted [B] (the step's outputs);
        slots [B] int64, context requests first."""
        num_ctx = spec_metadata.num_context_requests
        emitted = num_accepted
        if num_ctx:
            self.state.start(slots[:num_ctx], input_ids[:attn.num_context_tokens], attn.context_lens,
                             attn.chunk_starts)
            if self.pool is not None:
                self.pool.rebuild(slots[:num_ctx], self.state)
            if spec_metadata.has_partial_contexts:  # a partial chunk's sampled token is discarded
                ctx_emitted = torch.where(spec_metadata.partial_contexts[:num_ctx], 0, num_accepted[:num_ctx])
                emitted = torch.cat([ctx_emitted, num_accepted[num_ctx:]])
        self.state.extend(slots, new_tokens, emitted)
        if self.pool is not None:
            self.pool.extend(slots, new_tokens, emitted)

    def propose(self, slots: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts [B, k] int64, use [B] bool: the match reaches the threshold): from the request's own text, or
        from the global pool where its match is longer."""
        drafts, match_len = self.state.propose(slots, k)
        if self.pool is not None:
            pool_drafts, pool_len = self.pool.propose(slots, k)
            drafts = torch.where((pool_len > match_len)[:, None], pool_drafts, drafts)
            match_len = torch.maximum(match_len, pool_len)
        return drafts, match_len >= self.threshold

    def override(self, drafts: torch.Tensor, slots: torch.Tensor, draft_probs: torch.Tensor | None) -> torch.Tensor:
        """A head's drafts [B, k] with those of requests whose text repeats replaced by the text's continuation.
        ``draft_probs`` [slots, >= k, V] (rejection sampling's record of what the drafts were drawn from, or None):
        a replaced request's rows become one-hot, the automaton's drafts being deterministic."""
        k = drafts.shape[1]
        if k == 0:
            return drafts
        sa_drafts, use = self.propose(slots, k)
        if draft_probs is not None:
            one_hot = torch.zeros_like(draft_probs[slots, :k]).scatter_(2, sa_drafts[:, :, None], 1.0)
            draft_probs[slots, :k] = torch.where(use[:, None, None], one_hot, draft_probs[slots, :k])
        return torch.where(use[:, None], sa_drafts, drafts)

    def override_tree(self, drafts: torch.Tensor, chain: torch.Tensor, slots: torch.Tensor, greedy: torch.Tensor
                      ) -> torch.Tensor:
        """A tree's drafts [B, N] (node i at column i - 1) with the automaton's chain along each tree's first
        children (chain [B, D] node indices, 0 past its end) where the text repeats, for greedy requests (greedy
        [B] bool): a tree is verified by its deepest path of the target's own tokens, so any drafts keep it
        lossless; a sampled request's children stay the head's, drawn from the distributions rejection sampling
        verifies them against."""
        sa_drafts, use = self.propose(slots, chain.shape[1])
        replace = (use & greedy)[:, None] & (chain > 0)
        columns = torch.where(replace, chain - 1, drafts.shape[1])  # the rest write a scratch column
        padded = torch.cat([drafts, drafts[:, :1]], dim=1)
        return padded.scatter(1, columns, sa_drafts)[:, :-1]