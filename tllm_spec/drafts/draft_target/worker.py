"""DraftTargetOneModelWorker: verify the last drafts, accept, then a draft LM catches up and drafts K tokens."""
from __future__ import annotations

import torch

from ...config import DraftTargetConfig
from ...model.attention import AttentionMetadata
from ...model.kv_cache import KVCache
from ...model.target import TargetModel
from ..base import SpecWorkerBase
from ..metadata import SpecMetadata
from .model import load_draft_lm


class DraftTargetOneModelWorker(SpecWorkerBase):
    """The draft-LM part of the one-model step (TensorRT-LLM ``DraftTargetOneModelWorker``).

    The draft reads tokens themselves, not shifted pairs: at every position it holds the K/V of the token there,
    in its own layers of the request's pages. Its first pass of a step catches up on what the step accepted, in one
    forward; then K - 1 one-token passes draft the rest.

    Worked trace, prompt ``A B C D`` then K = 3:

    * step 1 (context): the target sees ``A B C D`` at positions 0-3 and samples ``E``. The draft's first pass
      sees ``A B C D E`` at positions 0-4 (the prompt, and the token after its last row) and proposes ``e1``
      from the row of ``E``; two one-token passes at positions 5, 6 see ``e1``, ``e2`` and propose ``e2 e3``.
      next_new_tokens ``[E e1 e2 e3]``.
    * step 2 (generation): the target sees ``E e1 e2 e3`` at positions 4-7 and samples ``t0 t1 t2 t3``; say
      ``e1 == t0``, ``e2 != t1``: accepted ``[t0 t1]`` (n = 2, ``t1`` the correction). The draft's first pass sees
      the token after each row, ``t0 t1 t2 t3``, at positions 5-8: rows 5, 6 (``t0 t1``) are the committed text
      (``E`` at 4 it wrote last step), and ``e1'`` comes from row 6 (n - 1). Rows 7, 8 and the one-token passes at
      7, 8 write past the accepted length (a length change rewinds them; the next first pass overwrites them).
    * chunked prefill, chunks ``A B`` then ``C D``: the first chunk's pass sees ``A B C`` at 0-2 (``C``: the next
      prompt token, known on the host); the second chunk's sees ``C D E`` at 2-4, rewriting position 2 with the
      same token, and runs as step 1 from there.
    """

    def __init__(self, max_draft_len: int, draft_model: TargetModel, use_flashinfer: bool = True,
                 use_rejection_sampling: bool = False):
        super().__init__(max_draft_len, use_flashinfer, use_rejection_sampling)
        self.draft_model = draft_model

    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        return self.draft_model.kv_layer_shapes()

    @property
    def kv_lookahead(self) -> int:
        return 0  # the draft LM reads the tokens themselves: its K/V at p is a function of tokens <= p

    def fuse(self, max_positions: int) -> None:
        self.draft_model.fuse(max_positions)

    def compile(self) -> None:
        self.draft_model.compile()

    def bind_kv_cache(self, kv_cache: KVCache) -> None:
        if self.draft_model.fused is not None:
            self.draft_model.fused.bind_kv_cache(kv_cache)

    def forward(self, input_ids: torch.Tensor, target_logits: torch.Tensor, target_features: torch.Tensor,
                draft_tokens: torch.Tensor, attn: AttentionMetadata, spec_metadata: SpecMetadata
                ) -> dict[str, torch.Tensor]:
        """input_ids [T]; target_logits [R, V]; target_features unused (the draft reads tokens); draft_tokens
        [G, k] being verified. Returns the TensorRT-LLM output dict."""
        num_ctx = spec_metadata.num_context_requests
        slots = attn.token_slots[spec_metadata.gather_ids[spec_metadata.first_rows()]]  # [B] KV slot per request
        self._execute_guided_decoder_if_present(target_logits)
        target_tokens = self.sample_target(target_logits, spec_metadata)
        new_tokens, num_accepted = self.accept_tokens(target_tokens, draft_tokens, num_ctx, spec_metadata,
                                                      target_logits, slots[num_ctx:])
        self._add_guided_draft_batch_if_present(num_accepted)
        next_draft_tokens = self.draft(input_ids, self.row_tokens(new_tokens, spec_metadata), num_accepted, attn,
                                       spec_metadata)
        return {
            "new_tokens": new_tokens,
            "new_tokens_lens": num_accepted,
            "next_draft_tokens": next_draft_tokens,
            "next_new_tokens": self._prepare_next_new_tokens(new_tokens, num_accepted, next_draft_tokens),
        }

    def draft(self, input_ids: torch.Tensor, row_tokens: torch.Tensor, num_accepted: torch.Tensor,
              attn: AttentionMetadata, spec_metadata: SpecMetadata) -> torch.Tensor:
        """The catch-up pass (which writes the draft's K/V of the step's tokens, so it runs even when nothing is
        proposed), then from each request's last accepted token a chain of next_draft_len drafts, one pass a
        token. row_tokens [R]: the emitted token after each sampling row. Returns [B, next_draft_len] int64."""
        ids, draft_attn, last = catch_up_batch(input_ids, row_tokens, num_accepted, attn, spec_metadata)
        hidden, _ = self.draft_model(ids, draft_attn)
        next_k = spec_metadata.next_draft_len
        if next_k == 0:
            return last.new_zeros(last.shape[0], 0)
        slots, position = draft_attn.token_slots[last], draft_attn.positions[last]
        drafts = [self._propose(hidden[last], 0, slots, spec_metadata)]
        for step in range(1, next_k):
            position = position + 1
            hidden, _ = self.draft_model(drafts[-1], attn.for_tokens(slots, position))
            drafts.append(self._propose(hidden, step, slots, spec_metadata))
        return torch.stack(drafts, dim=1)

    def _propose(self, hidden: torch.Tensor, step: int, slots: torch.Tensor, spec_metadata: SpecMetadata
                 ) -> torch.Tensor:
        """Draft ``step`` from the draft's final-normed hidden [B, H]: argmax, or a sample kept for rejection
        sampling. Returns [B] int64."""
        logits = self.draft_model.compute_logits(hidden)
        return self.draft_tokens_from_logits(logits, None, step, slots, spec_metadata)


def catch_up_batch(input_ids: torch.Tensor, row_tokens: torch.Tensor, num_accepted: torch.Tensor,
                   attn: AttentionMetadata, spec_metadata: SpecMetadata
                   ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """The draft's first pass of a step: each context request's chunk and the token after its last row (n + 1
    tokens from its chunk's start), then each generation request's k + 1 row tokens one position after the
    target's. Returns (ids [D] int64, its attention metadata, last [B]: the row of each request's last accepted
    token, whose logits propose its first draft). Context sizes are host values; a generation-only step (graphed)
    builds nothing on the host."""
    num_ctx, num_gen = spec_metadata.num_context_requests, spec_metadata.num_generation_requests
    num_ctx_tokens = attn.num_context_tokens
    rows_per_gen = spec_metadata.draft_len + 1
    ids = row_tokens[num_ctx:]
    positions, slots = attn.positions[num_ctx_tokens:] + 1, attn.token_slots[num_ctx_tokens:]
    writes = None if attn.write_slots is None else attn.write_slots[num_ctx_tokens:]
    gen_first = num_ctx_tokens + num_ctx + torch.arange(num_gen, device=ids.device) * rows_per_gen
    last = gen_first + num_accepted[num_ctx:] - 1
    if num_ctx:
        order, ctx_last = _context_order(attn.context_lens, input_ids.device)
        ends = spec_metadata.gather_ids[:num_ctx]  # flat index of each context request's last token
        ctx_ids = torch.cat([input_ids[:num_ctx_tokens], row_tokens[:num_ctx]])[order]
        ctx_positions = torch.cat([attn.positions[:num_ctx_tokens], attn.positions[ends] + 1])[order]
        ctx_slots = torch.cat([attn.token_slots[:num_ctx_tokens], attn.token_slots[ends]])[order]
        ids, positions = torch.cat([ctx_ids, ids]), torch.cat([ctx_positions, positions])
        slots = torch.cat([ctx_slots, slots])
        writes = None if writes is None else torch.cat([ctx_slots, writes])
        last = torch.cat([ctx_last, last])
    draft_attn = AttentionMetadata(attn.kv_cache, positions, slots, attn.max_kv_len + 1,
                                   tuple(n + 1 for n in attn.context_lens), writes, rows_per_gen, attn.context_starts)
    return ids, draft_attn, last


def _context_order(context_lens: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Index into cat(context tokens [C], one extra per request [num_ctx]) that puts each request's extra token
    after its chunk, and the row of each extra token in that order. -> ([C + num_ctx], [num_ctx]) int64."""
    num_ctx_tokens, order, ends, start = sum(context_lens), [], [], 0
    for i, n in enumerate(context_lens):
        order += [*range(start, start + n), num_ctx_tokens + i]
        start += n
        ends.append(len(order) - 1)
    return (torch.tensor(order, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(ends, dtype=torch.int64).to(device, non_blocking=True))


def build_draft_target_worker(target: TargetModel, cfg: DraftTargetConfig, max_batch_size: int
                              ) -> DraftTargetOneModelWorker:
    """The worker for ``cfg``: the draft LM from ``cfg.speculative_model`` in the target's dtype and device
    (replicated on every tensor-parallel rank). ``max_batch_size`` is unused: the draft keeps no per-request state
    beyond its KV layers (the same signature as the other build functions)."""
    dtype, device = target.lm_head.weight.dtype, target.lm_head.weight.device
    draft = load_draft_lm(cfg.speculative_model, target, dtype, device)
    return DraftTargetOneModelWorker(cfg.max_draft_len, draft, use_rejection_sampling=cfg.use_rejection_sampling)
