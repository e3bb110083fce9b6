"""MTP one-model workers: MTP-Eagle (module 0 reused K times) and vanilla MTP (N distinct modules).

TensorRT-LLM semantics (``tensorrt_llm/_torch/speculative/mtp.py``): ``MTPEagleWorker`` runs module 0 over the
step's tokens, then one token per request for the remaining steps; ``MTPWorker`` runs N modules in sequence,
each over a per-request window, tokens shifted left by one per module with the newest draft appended. The
hidden handed on is ``MTPConfig.mtp_hidden_feedback``: default ``"post_norm"`` (after ``shared_head.norm``, the
analogue of the target's final-normed hidden that ``hnorm`` was trained on; what TensorRT-LLM's ``DeepseekV3MTP``,
SGLang's ``deepseek_nextn``, vLLM since PR #45895 and transformers' ``MtpLayer`` hand on); ``"pre_norm"`` (the
block output) for modules trained that way, such as the shipped demo module.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import replace

import torch

from ...config import MTPConfig
from ...model.attention import AttentionMetadata
from ...model.target import TargetModel
from ...sampling.forcing import forced_num_accepted
from ..base import SpecWorkerBase, with_context_rows
from ..metadata import SpecMetadata
from ..sa.enhancer import SADraftEnhancer
from .checkpoint import load_mtp_checkpoint
from .model import MTPDraftModel
from .relaxed import RelaxedAcceptance


class _MTPWorkerBase(SpecWorkerBase):
    """Sample, accept (strict, or relaxed inside thinking), then :meth:`draft`."""

    def __init__(self, max_draft_len: int, draft_model: MTPDraftModel, relaxed: RelaxedAcceptance | None = None,
                 use_flashinfer: bool = True, use_rejection_sampling: bool = False):
        super().__init__(max_draft_len, use_flashinfer, use_rejection_sampling)
        self.draft_model = draft_model
        self.relaxed = relaxed

    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        return self.draft_model.kv_shapes()

    def fuse(self, max_positions: int) -> None:
        self.draft_model.fuse(max_positions)

    def forward(self, input_ids: torch.Tensor, target_logits: torch.Tensor, target_features: torch.Tensor,
                draft_tokens: torch.Tensor, attn: AttentionMetadata, spec_metadata: SpecMetadata
                ) -> dict[str, torch.Tensor]:
        """input_ids [T]; target_logits [R, V]; target_features [T, H] (final-normed target hidden);
        draft_tokens [G, k] being verified. Returns the TensorRT-LLM output dict."""
        num_ctx = spec_metadata.num_context_requests
        slots = attn.token_slots[spec_metadata.gather_ids[spec_metadata.first_rows()]]  # [B] KV slot per request
        self._execute_guided_decoder_if_present(target_logits)
        target_tokens = self.sample_target(target_logits, spec_metadata)
        if self.relaxed is None:
            new_tokens, num_accepted = self.accept_tokens(target_tokens, draft_tokens, num_ctx, spec_metadata,
                                                          target_logits, slots[num_ctx:])
        else:
            new_tokens, num_accepted = self._accept_relaxed(input_ids, target_logits, target_tokens, draft_tokens,
                                                            slots, spec_metadata)
        # the accepted token after each row (under relaxed acceptance possibly a draft, not the target's)
        row_tokens = self.row_tokens(new_tokens, spec_metadata)
        self._add_guided_draft_batch_if_present(num_accepted)
        next_draft_tokens = self.draft(input_ids, row_tokens, target_features, num_accepted, attn, spec_metadata)
        next_draft_tokens = self._enhance_drafts(input_ids, new_tokens, num_accepted, next_draft_tokens, attn,
                                                 spec_metadata, slots)
        return {
            "new_tokens": new_tokens,
            "new_tokens_lens": num_accepted,
            "next_draft_tokens": next_draft_tokens,
            "next_new_tokens": self._prepare_next_new_tokens(new_tokens, num_accepted, next_draft_tokens),
        }

    @abstractmethod
    def draft(self, input_ids: torch.Tensor, row_tokens: torch.Tensor, target_features: torch.Tensor,
              num_accepted: torch.Tensor, attn: AttentionMetadata, spec_metadata: SpecMetadata) -> torch.Tensor:
        """Next drafts [B, k'] int64 (k' = spec_metadata.next_draft_len). row_tokens [R]: the accepted token
        following each sampled row."""

    def prefix_reused(self, slot: int, tokens: list[int]) -> None:
        super().prefix_reused(slot, tokens)
        if self.relaxed is not None:
            self.relaxed.prefix_reused(slot, tokens)

    def _propose(self, module: int, hidden: torch.Tensor, step: int, slots: torch.Tensor,
                 spec_metadata: SpecMetadata) -> torch.Tensor:
        """Draft ``step`` from ``module``'s pre-norm hidden [B, H]: argmax, or a sample kept for rejection
        sampling. slots [B]. Returns [B] int64."""
        logits = self.draft_model.compute_logits(module, hidden)
        return self.draft_tokens_from_logits(logits, None, step, slots, spec_metadata)

    def _accept_relaxed(self, input_ids: torch.Tensor, target_logits: torch.Tensor, target_tokens: torch.Tensor,
                        draft_tokens: torch.Tensor, slots: torch.Tensor, spec_metadata: SpecMetadata
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like :meth:`accept_tokens` with the relaxed rule; updates the per-slot thinking state. slots [B]."""
        num_ctx = spec_metadata.num_context_requests
        continued = spec_metadata.continued_contexts[:num_ctx] if spec_metadata.has_continued_contexts else None
        thinking = self.relaxed.start_state(input_ids, spec_metadata.gather_ids[:num_ctx], slots, continued)
        num_gen_accepted, gen_tokens = self.relaxed.accept(target_logits[num_ctx:], target_tokens[num_ctx:],
                                                           draft_tokens, thinking[num_ctx:])
        if self.forcing:
            num_gen_accepted = forced_num_accepted(self.forced_value, draft_tokens.shape[1],
                                                   draft_tokens.shape[0], spec_metadata.seed, spec_metadata.offset)
        new_tokens, num_accepted = with_context_rows(target_tokens, num_ctx, gen_tokens, num_gen_accepted)
        emitted = num_accepted
        if spec_metadata.has_partial_contexts:  # a partial prompt chunk emits nothing: it keeps its prompt's state
            ctx_emitted = torch.where(spec_metadata.partial_contexts[:num_ctx], 0, num_accepted[:num_ctx])
            emitted = torch.cat([ctx_emitted, num_accepted[num_ctx:]])
        self.relaxed.commit(new_tokens, emitted, thinking, slots)
        return new_tokens, num_accepted


class MTPEagleWorker(_MTPWorkerBase):
    """MTP-Eagle (TensorRT-LLM ``MTPEagleWorker``): K drafts chained EAGLE-style, one position per draft step.

    Draft step k runs module ``step_modules[k]``: module 0 every time (``mtp_layer_selection="first"``), or module
    k mod N (``"per_step"``: vLLM's ``spec_step_idx % num_mtp_layers``, Step-3.5's round-robin layers). Every
    module reads the same sequence of (token, hidden) pairs, so each module used at step k or later runs at the
    position drafted at step k, keeping its own KV layer complete (a module that skipped a position would later
    attend a stale entry there).

    Worked trace, prompt ``A B C D`` then K = 3, ``"first"`` (h_p: the target's final-normed hidden at position p):

    * step 1 (context): the target sees ``A B C D`` at positions 0-3 and samples ``E``. Module 0 sees
      ``(B, h_0) (C, h_1) (D, h_2) (E, h_3)`` at positions 0-3 (its own KV layer) and proposes ``e1`` from the
      row of ``D``; two one-token passes at positions 4, 5 see ``(e1, g_3)`` and ``(e2, g_4)`` where g is the
      fed-back module output, and propose ``e2 e3``. next_new_tokens ``[E e1 e2 e3]``.
    * step 2 (generation): the target sees ``E e1 e2 e3`` at positions 4-7 and samples ``t0 t1 t2 t3``; say
      ``e1 == t0``, ``e2 != t1``: accepted ``[t0 t1]`` (n = 2). Module 0 sees ``(t0, h_4) (t1, h_5) (t2, h_6)
      (t3, h_7)`` at 4-7 (rows 6, 7 are junk beyond the accepted length, never read) and drafts from row 5
      (n - 1); the one-token passes write positions 6, 7, which the next step's first pass overwrites.

    ``"per_step"`` with N = 2: the first pass runs modules 0 and 1 over positions 0-3 (``e1`` from module 0); the
    pass at position 4 runs modules 1 and 0 on ``(e1, g_3)`` (``e2`` from module 1, whose output is fed back); the
    pass at position 5 runs module 0 only (``e3``), the last step.
    """

    def __init__(self, max_draft_len: int, draft_model: MTPDraftModel, num_step_modules: int = 1,
                 relaxed: RelaxedAcceptance | None = None, use_flashinfer: bool = True,
                 use_rejection_sampling: bool = False):
        super().__init__(max_draft_len, draft_model, relaxed, use_flashinfer, use_rejection_sampling)
        self.step_modules = tuple(k % num_step_modules for k in range(max_draft_len))  # module of draft step k

    def draft(self, input_ids: torch.Tensor, row_tokens: torch.Tensor, target_features: torch.Tensor,
              num_accepted: torch.Tensor, attn: AttentionMetadata, spec_metadata: SpecMetadata) -> torch.Tensor:
        gather_ids = spec_metadata.gather_ids[:spec_metadata.num_rows]
        next_ids = self._prepare_context_input_ids(input_ids, gather_ids, row_tokens)
        outs = self._run_modules(0, next_ids, target_features, attn)
        last = gather_ids[spec_metadata.first_rows() + num_accepted - 1]  # [B] flat index of the last accepted
        if spec_metadata.next_draft_len == 0:  # the first pass wrote the modules' KV; nothing to propose
            return last.new_zeros(last.shape[0], 0)
        hidden, positions, slots = outs[self.step_modules[0]][last], attn.positions[last], attn.token_slots[last]
        drafts = [self._propose(self.step_modules[0], hidden, 0, slots, spec_metadata)]
        for step in range(1, spec_metadata.next_draft_len):
            positions = positions + 1
            fed_back = self.draft_model.feedback(self.step_modules[step - 1], hidden)
            outs = self._run_modules(step, drafts[-1], fed_back, attn.for_tokens(slots, positions))
            hidden = outs[self.step_modules[step]]
            drafts.append(self._propose(self.step_modules[step], hidden, step, slots, spec_metadata))
        return torch.stack(drafts, dim=1)

    def _run_modules(self, step: int, input_ids: torch.Tensor, hidden: torch.Tensor, attn: AttentionMetadata
                     ) -> dict[int, torch.Tensor]:
        """Every module used at ``step`` or later over these tokens (writing its KV layer there).
        input_ids [N], hidden [N, H] -> {module: pre-norm output [N, H]}."""
        return {m: self.draft_model(m, input_ids, hidden, attn) for m in sorted(set(self.step_modules[step:]))}


class MTPWorker(_MTPWorkerBase):
    """Vanilla MTP (TensorRT-LLM ``MTPWorker``): N distinct modules, one draft each, chained as in the
    DeepSeek-V3 report. Module k (1-based) at position i reads token x[i+k] and the hidden g^{k-1}_i handed on by
    module k-1 at the same position (g^0 = the target's hidden), attending over its own KV layer.

    Module k's KV at position i is final once x[i+k] is committed; the later positions (at most N-1 before the
    step's tokens) are recomputed each step. So each generation request runs every module over a fixed window
    of 2N positions ``L0-N+1 .. L0+N`` (L0 = position of the step's first token): N-1 past positions, whose
    target hiddens and tokens are kept per KV slot on the device, plus the step's N+1 tokens. Positions past
    the accepted length are junk (written, never read); negative positions write to the scratch page.

    Chunked prefill: a partial prompt chunk ending before position e reads x[e .. e+N-1], prompt tokens known on
    the host (``context_lookahead`` = N: such a chunk ends at least N tokens before its prompt's end), so every
    module's KV over the chunk is final; the final chunk (at least N tokens) runs as a whole prompt does.

    Worked trace, N = 3, prompt ``A B C D`` (positions 0-3), h_p target hidden, g^k_p module k's hand-on:

    * step 1 (context): target samples ``E``. Module 1 sees ``(B,h_0) (C,h_1) (D,h_2) (E,h_3)`` at 0-3 and
      proposes ``F`` from the ``D`` row; module 2 sees the tokens shifted left with ``F`` at the last row,
      ``(C,g1_0) (D,g1_1) (E,g1_2) (F,g1_3)``, and proposes ``G``; module 3 sees ``(D,g2_0) (E,g2_1) (F,g2_2)
      (G,g2_3)`` and proposes ``H``. The slot keeps positions 2, 3: hiddens ``h_2 h_3``, next tokens ``D E``.
    * step 2: the target sees ``E F G H`` at 4-7 and accepts ``F`` then corrects to ``X`` (n = 2, so the last
      accepted position is 5). Every module runs over positions 2-7: module 1 over ``(D,h_2) (E,h_3) (F,h_4)
      (X,h_5)`` plus two junk rows and drafts from position 5; module 2's rows read x[i+2], so position 3 now
      reads the committed ``F`` (a draft last step) and position 5 the new module-1 draft. The slot then
      keeps positions 4, 5.
    """

    def __init__(self, num_modules: int, draft_model: MTPDraftModel, max_batch_size: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device | str, relaxed: RelaxedAcceptance | None = None,
                 use_flashinfer: bool = True, use_rejection_sampling: bool = False):
        super().__init__(num_modules, draft_model, relaxed, use_flashinfer, use_rejection_sampling)
        window, num_slots = num_modules - 1, max_batch_size + 1  # + the CUDA-graph padding slot
        self.register_buffer("past_tokens", torch.zeros(num_slots, window, dtype=torch.int64, device=device),
                             persistent=False)  # [slots, N-1] int64: x[p+1] for the N-1 positions p before L0
        self.register_buffer("past_hidden", torch.zeros(num_slots, window, hidden_size, dtype=dtype,
                                                        device=device), persistent=False)  # [slots, N-1, H] h_p

    @property
    def context_lookahead(self) -> int:
        return self.max_draft_len  # module N at a chunk's last position p reads x[p+N]

    def draft(self, input_ids: torch.Tensor, row_tokens: torch.Tensor, target_features: torch.Tensor,
              num_accepted: torch.Tensor, attn: AttentionMetadata, spec_metadata: SpecMetadata) -> torch.Tensor:
        gather_ids = spec_metadata.gather_ids[:spec_metadata.num_rows]
        slots = attn.token_slots[gather_ids[spec_metadata.first_rows()]]  # [B]
        next_ids = self._prepare_context_input_ids(input_ids, gather_ids, row_tokens)  # x[p+1] per position
        tokens, hidden, draft_attn, last = self._window_batch(next_ids, target_features, num_accepted, attn,
                                                              spec_metadata, slots)
        self._keep_window(tokens, hidden, last, slots)
        drafts = []
        for k in range(self.max_draft_len):
            out = self.draft_model(k, tokens, hidden, draft_attn)
            drafts.append(self._propose(k, out[last], k, slots, spec_metadata))
            if k + 1 < self.max_draft_len:
                hidden = self.draft_model.feedback(k, out)
                # x[i+k+1]: the draft at the last row (a partial prompt chunk: the prompt token there)
                at_last = spec_metadata.with_next_prompt_tokens(drafts[-1], k + 1)
                tokens = torch.roll(tokens, -1).index_copy(0, last, at_last)
        return torch.stack(drafts, dim=1)

    def _window_batch(self, next_ids: torch.Tensor, features: torch.Tensor, num_accepted: torch.Tensor,
                      attn: AttentionMetadata, spec_metadata: SpecMetadata, slots: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The modules' flat batch: context rows as the target saw them, then 2N window rows per generation
        request. Returns (tokens [D] x[p+1], hidden [D, H] h_p, attention metadata, last [B] row of each
        request's last accepted position)."""
        n = self.max_draft_len
        num_ctx, num_gen = spec_metadata.num_context_requests, spec_metadata.num_generation_requests
        num_ctx_tokens = next_ids.shape[0] - num_gen * (n + 1)
        gen_slots = slots[num_ctx:]
        step_ids = next_ids[num_ctx_tokens:].view(num_gen, n + 1)
        step_hidden = features[num_ctx_tokens:].view(num_gen, n + 1, features.shape[-1])
        gen_tokens = torch.cat([self.past_tokens[gen_slots], step_ids], dim=1)  # [G, 2N]
        gen_hidden = torch.cat([self.past_hidden[gen_slots], step_hidden.to(self.past_hidden.dtype)], dim=1)
        tokens = torch.cat([next_ids[:num_ctx_tokens], gen_tokens.flatten()])
        hidden = torch.cat([features[:num_ctx_tokens], gen_hidden.flatten(0, 1)])
        first_pos = attn.positions[num_ctx_tokens:].view(num_gen, n + 1)[:, :1]
        window_pos = first_pos - (n - 1) + torch.arange(2 * n, device=first_pos.device)  # [G, 2N]
        positions = torch.cat([attn.positions[:num_ctx_tokens], window_pos.flatten()])
        token_slots = torch.cat([attn.token_slots[:num_ctx_tokens], gen_slots.repeat_interleave(2 * n)])
        gen_last = (num_ctx_tokens + torch.arange(num_gen, device=slots.device) * 2 * n
                    + num_accepted[num_ctx:] + n - 2)
        last = torch.cat([spec_metadata.gather_ids[:num_ctx], gen_last])
        return tokens, hidden, _window_attention(attn, token_slots, positions), last

    def _keep_window(self, tokens: torch.Tensor, hidden: torch.Tensor, last: torch.Tensor, slots: torch.Tensor
                     ) -> None:
        """Store the N-1 positions ending at each request's last accepted one (the next step's past rows)."""
        n = self.max_draft_len
        if n == 1:
            return
        rows = (last[:, None] - (n - 2) + torch.arange(n - 1, device=last.device)).clamp(min=0)  # [B, N-1]
        self.past_tokens.index_copy_(0, slots, tokens[rows])
        self.past_hidden.index_copy_(0, slots, hidden[rows].to(self.past_hidden.dtype))


def build_mtp_worker(target: TargetModel, cfg: MTPConfig, max_batch_size: int) -> _MTPWorkerBase:
    """The worker for ``cfg``: weights from ``cfg.mtp_checkpoint`` or the target's own directory. Vanilla MTP
    loads ``num_nextn_predict_layers`` modules; MTP-Eagle loads module 0, or with per-step layer selection the
    modules its K steps use."""
    source = cfg.mtp_checkpoint or target.checkpoint_dir
    if source is None:
        raise ValueError("MTP weights: the target was not loaded from a directory; set MTPConfig.mtp_checkpoint")
    dtype, device = target.lm_head.weight.dtype, target.lm_head.weight.device
    vanilla = cfg.spec_dec_mode.is_mtp_vanilla()
    per_step = cfg.mtp_layer_selection == "per_step"
    num_modules = cfg.num_nextn_predict_layers if vanilla else (
        min(cfg.num_nextn_predict_layers, cfg.num_draft_tokens) if per_step else 1)
    ckpt = load_mtp_checkpoint(source, target.num_layers, num_modules)
    draft = MTPDraftModel.from_checkpoint(ckpt, target, cfg.mtp_hidden_feedback, dtype, device)
    relaxed = None
    if cfg.use_relaxed_acceptance_for_thinking:
        if cfg.use_rejection_sampling:
            raise ValueError("MTPConfig: use_relaxed_acceptance_for_thinking and use_rejection_sampling are "
                             "exclusive (relaxed acceptance judges argmax drafts against the target's top-k)")
        relaxed = RelaxedAcceptance(cfg.relaxed_topk, cfg.relaxed_delta, cfg.begin_thinking_phase_token,
                                    cfg.end_thinking_phase_token, max_batch_size, device)
    options = dict(relaxed=relaxed, use_rejection_sampling=cfg.use_rejection_sampling)
    if vanilla:
        worker = MTPWorker(num_modules, draft, max_batch_size, target.hidden_size, dtype, device, **options)
    else:
        worker = MTPEagleWorker(cfg.num_draft_tokens, draft, num_modules, **options)
    worker.sa_enhancer = SADraftEnhancer(cfg.sa_spec_threshold) if cfg.use_sa_spec else None
    return worker


def _window_attention(attn: AttentionMetadata, token_slots: torch.Tensor, positions: torch.Tensor
                      ) -> AttentionMetadata:
    """The step's metadata (context part unchanged) over the window rows. Rows at negative positions (short
    prompts) attend position 0 and write their K/V to the scratch page, so no real entry is touched."""
    padding = torch.full_like(token_slots, attn.kv_cache.padding_slot)  # its block-table row is all scratch
    return replace(attn, positions=positions.clamp(min=0), token_slots=token_slots,
                   write_slots=torch.where(positions >= 0, token_slots, padding), tokens_per_request=1)
