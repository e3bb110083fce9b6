"""Eagle3OneModelWorker: verify the last drafts, accept, and draft K new tokens with the EAGLE-3 head."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...config import Eagle3Config
from ...model.attention import AttentionMetadata
from ...model.target import TargetModel
from ..base import SpecWorkerBase
from ..metadata import SpecMetadata
from ..sa.enhancer import SADraftEnhancer
from ..tree import DraftTree
from .checkpoint import load_eagle3_checkpoint
from .model import Eagle3DraftModel, resolve_capture_layers
from .dynamic_tree import DynamicTreeStep
from .tree_step import TreeStep


class Eagle3OneModelWorker(SpecWorkerBase):
    """The EAGLE-3 part of the one-model step.

    Worked trace, prompt ``A B C D`` then K = 3:

    * step 1 (context): the target sees ``A B C D`` at positions 0-3 and samples ``E`` after ``D``. The
      draft's first pass sees the target features of positions 0-3 paired with the *next* tokens
      ``B C D E`` and proposes ``e1`` from the row of ``D``; two more one-token passes (positions 4, 5)
      propose ``e2 e3``. Output: new_tokens ``[E]``, next_new_tokens ``[E e1 e2 e3]``.
    * step 2 (generation): the target sees ``E e1 e2 e3`` at positions 4-7 and samples ``t0 t1 t2 t3``.
      Say ``e1 == t0`` and ``e2 != t1``: accepted ``[t0 t1]`` (n = 2; ``t1`` is the correction). Target KV
      of positions 4-5 (``E e1``) is kept; 6-7 are rewound by the engine (a length change). The draft's
      first pass sees positions 4-7 paired with ``t0 t1 t2 t3``; only rows 4-5 are valid and the next
      draft comes from row 5 (n - 1); its one-token passes write draft KV at positions 6, 7, which the
      next step's first pass overwrites.
    * chunked prefill, chunks ``A B`` then ``C D``: the first chunk's draft pass pairs positions 0-1 with
      ``B C`` (``C``, the next prompt token, is known on the host); what it samples and drafts is discarded.
      The second chunk runs as step 1 above over positions 2-3, attending the KV of 0-1 that the first wrote.
    """

    def __init__(self, max_draft_len: int, draft_model: Eagle3DraftModel, use_flashinfer: bool = True,
                 use_rejection_sampling: bool = False, tree: DraftTree | DynamicTreeStep | None = None):
        """``tree``: a static tree, or a dynamic one's step; either way the step verifies its N drafts."""
        tree_step = TreeStep(tree) if isinstance(tree, DraftTree) else tree
        super().__init__(tree_step.num_nodes if tree_step is not None else max_draft_len, use_flashinfer,
                         use_rejection_sampling)
        self.draft_model = draft_model
        self.tree_step = tree_step

    def allocate_state(self, num_slots: int, vocab_size: int, device: torch.device, max_positions: int = 0) -> None:
        super().allocate_state(num_slots, vocab_size, device, max_positions)
        if self.tree_step is not None:
            self.tree_step.allocate(num_slots, device)

    @property
    def draft_prob_rows(self) -> int:
        return self.tree_step.num_parents if self.tree_step is not None else self.max_draft_len

    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        return [self.draft_model.kv_shape]

    def shard_refusal(self, parallel) -> str | None:
        return self.draft_model.shard_refusal(parallel)

    def shard_draft(self, parallel) -> None:
        self.draft_model.shard(parallel)

    def fuse(self, max_positions: int) -> None:
        self.draft_model.fuse(max_positions)

    def compile(self) -> None:
        self.draft_model.compile()

    def forward(self, input_ids: torch.Tensor, target_logits: torch.Tensor, target_features: torch.Tensor,
                draft_tokens: torch.Tensor, attn: AttentionMetadata, spec_metadata: SpecMetadata
                ) -> dict[str, torch.Tensor]:
        """input_ids [T]; target_logits [R, V]; target_features [T, 3H_t] (aux hidden states);
        draft_tokens [G, k] being verified. Returns the TensorRT-LLM output dict."""
        num_contexts = spec_metadata.num_context_requests
        self._execute_guided_decoder_if_present(target_logits)
        target_tokens = self.sample_target(target_logits, spec_metadata)
        first_tokens = spec_metadata.gather_ids[spec_metadata.first_rows()[num_contexts:]]
        gen_slots = attn.token_slots[first_tokens]
        paths = None
        if self.is_tree(draft_tokens.shape[1]):
            sampled = None
            if self.samples_tree(spec_metadata):
                sampled = (target_logits[num_contexts:], self.draft_probs[gen_slots])
            new_tokens, num_accepted, paths = self.tree_step.accept(
                target_tokens, draft_tokens, num_contexts, spec_metadata, self.forced_value if self.forcing else None,
                gen_slots, sampled)
        else:
            new_tokens, num_accepted = self.accept_tokens(target_tokens, draft_tokens, num_contexts, spec_metadata,
                                                          target_logits, gen_slots)
        self._add_guided_draft_batch_if_present(
            num_accepted, None if paths is None else paths.gather(1, (num_accepted - 1)[:, None])[:, 0])
        if paths is None:
            row_tokens = self.row_tokens(new_tokens, spec_metadata)
        else:  # each row pairs with the token after it: the emitted one on the accepted path, else the target's
            gen_rows = path_tokens(target_tokens[num_contexts:], new_tokens[num_contexts:], num_accepted[num_contexts:],
                                   paths[num_contexts:])
            row_tokens = spec_metadata.with_next_prompt_tokens(torch.cat([new_tokens[:num_contexts, 0], gen_rows]), 0)
        next_draft_tokens = self.draft(input_ids, row_tokens, target_features, num_accepted, attn, spec_metadata,
                                       paths)
        if self.sa_enhancer is not None:
            slots = attn.token_slots[spec_metadata.gather_ids[spec_metadata.first_rows()]]
            chain = self.tree_step.first_child_chain(slots) if self.is_tree(spec_metadata.next_draft_len) else None
            next_draft_tokens = self._enhance_drafts(input_ids, new_tokens, num_accepted, next_draft_tokens, attn,
                                                     spec_metadata, slots, chain)
        out = {
            "new_tokens": new_tokens,
            "new_tokens_lens": num_accepted,
            "next_draft_tokens": next_draft_tokens,
            "next_new_tokens": self._prepare_next_new_tokens(new_tokens, num_accepted, next_draft_tokens),
        }
        if paths is not None:  # the row that produced each emitted token (its logprobs'): the path's nodes
            out["emitted_rows"] = emitted_rows(paths, num_contexts, new_tokens.shape[1])
        return out

    def verify_metadata(self, attn: AttentionMetadata, num_context_tokens: int, num_generation: int,
                        draft_len: int) -> AttentionMetadata:
        if not self.is_tree(draft_len):
            return attn
        return self.tree_step.verify_metadata(attn, num_context_tokens, num_generation)

    def is_tree(self, num_drafts: int) -> bool:
        """Whether a step's ``num_drafts`` drafts form the tree (N of them; fewer: a chain a draft-length
        schedule chose for the batch size)."""
        return self.tree_step is not None and num_drafts == self.tree_step.num_nodes

    def draft(self, input_ids: torch.Tensor, row_tokens: torch.Tensor, target_features: torch.Tensor,
              num_accepted: torch.Tensor, attn: AttentionMetadata, spec_metadata: SpecMetadata,
              paths: torch.Tensor | None = None) -> torch.Tensor:
        """The head's first pass over every token of the step (each row paired with the token after it), which
        writes the draft's KV at the step's positions (later steps attend it, so it runs even when nothing is
        proposed); after a tree was verified (``paths`` [B, D+1]: each request's accepted path), the accepted
        paths' K/V moved into place; then from each request's last accepted token the next drafts: the tree when
        next_draft_len is its size N, else a chain of next_draft_len (one head pass a token).

        row_tokens [R]: the emitted token after each sampling row. Returns [B, next_draft_len] int64."""
        hidden, gather_ids = self._first_pass(input_ids, row_tokens, target_features, attn, spec_metadata)
        first = spec_metadata.first_rows()
        if paths is None:
            last = gather_ids[first + num_accepted - 1]  # [B] flat index of the last accepted
            position = attn.positions[last]
        else:
            roots = gather_ids[first]  # flat index of each request's first token (a prompt's: its last)
            last = gather_ids[first + paths.gather(1, (num_accepted - 1)[:, None])[:, 0]]
            num_ctx = spec_metadata.num_context_requests
            if spec_metadata.num_generation_requests:
                self.tree_step.compact(attn.kv_cache, attn, roots[num_ctx:], paths[num_ctx:], num_accepted[num_ctx:])
            position = attn.positions[roots] + num_accepted - 1  # the last accepted token's row once compacted
        hidden, slots, next_k = hidden[last], attn.token_slots[last], spec_metadata.next_draft_len
        if self.is_tree(next_k):
            return self.tree_step.draft(self.draft_model, hidden, position, slots, attn, spec_metadata,
                                        self.draft_probs if self.samples_tree(spec_metadata) else None,
                                        self.guided_decoder)
        if next_k == 0:
            return last.new_zeros(last.shape[0], 0)
        drafts = [self._propose(hidden, 0, slots, spec_metadata)]
        for step in range(1, next_k):
            position = position + 1
            hidden = self.draft_model(drafts[-1], hidden, attn.for_tokens(slots, position))
            drafts.append(self._propose(hidden, step, slots, spec_metadata))
        return torch.stack(drafts, dim=1)

    def _first_pass(self, input_ids: torch.Tensor, row_tokens: torch.Tensor, target_features: torch.Tensor,
                    attn: AttentionMetadata, spec_metadata: SpecMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over every token of the step (each paired with the token after it) -> (hidden [T, H], the
        step's gather ids [R])."""
        gather_ids = spec_metadata.gather_ids[:spec_metadata.num_rows]
        draft_ids = self._prepare_context_input_ids(input_ids, gather_ids, row_tokens)
        return self.draft_model(draft_ids, target_features, attn), gather_ids

    def samples_tree(self, spec_metadata: SpecMetadata) -> bool:
        """Whether this step's tree is drawn and verified by rejection sampling (some request samples)."""
        return self.use_rejection_sampling and not spec_metadata.all_greedy

    def _propose(self, hidden: torch.Tensor, step: int, slots: torch.Tensor, spec_metadata: SpecMetadata
                 ) -> torch.Tensor:
        logits = self.draft_model.compute_logits(hidden)
        return self.draft_tokens_from_logits(logits, self.draft_model.vocab_offsets, step, slots, spec_metadata)


def emitted_rows(paths: torch.Tensor, num_contexts: int, tokens_per_request: int) -> torch.Tensor:
    """[B, N+1]: the flat logits row behind each emitted column of a tree step: node paths[b, j] of generation
    request g's block (a context request's: its one row). paths [B, D+1] (a context request's: zeros)."""
    num_gen = paths.shape[0] - num_contexts
    nodes = torch.cat([paths, paths[:, -1:].expand(-1, tokens_per_request - paths.shape[1])], dim=1)  # padded
    device = paths.device
    base = torch.cat([torch.arange(num_contexts, device=device),
                      num_contexts + torch.arange(num_gen, device=device) * tokens_per_request])
    return base[:, None] + nodes


def path_tokens(target_tokens: torch.Tensor, new_tokens: torch.Tensor, num_accepted: torch.Tensor,
                paths: torch.Tensor) -> torch.Tensor:
    """The token after each tree row of the generation requests: the emitted one at the accepted path's nodes
    (under rejection sampling it may differ from the target's own draw there), the target's elsewhere.
    target_tokens [G*(N+1)]; new_tokens [G, >= D+1]; num_accepted [G]; paths [G, D+1] -> [G*(N+1)]."""
    num_gen, depth = paths.shape
    if not num_gen:
        return target_tokens
    rows = F.pad(target_tokens.view(num_gen, -1), (0, 1))  # a scratch column takes the padding's writes
    on_path = torch.arange(depth, device=paths.device) < num_accepted[:, None]
    rows = rows.scatter(1, torch.where(on_path, paths, rows.shape[1] - 1), new_tokens[:, :depth])
    return rows[:, :-1].flatten()


def build_eagle3_worker(target: TargetModel, cfg: Eagle3Config, max_batch_size: int) -> Eagle3OneModelWorker:
    """The worker for ``cfg``: the head from ``cfg.speculative_model``, fed the target layers it was trained on
    (which this call makes the target capture). ``max_batch_size`` is unused: the head keeps no per-request
    state beyond the KV cache (the same signature as the MTP build function)."""
    tree = cfg.draft_tree if cfg.is_spec_dec_tree else None
    if cfg.use_dynamic_tree:
        tree = DynamicTreeStep(cfg.max_draft_len, cfg.dynamic_tree_max_topK, cfg.max_total_draft_tokens)
    if isinstance(tree, DraftTree):
        tree.tensors().relative_masks()  # a tree too big for the attention mask is refused here
    ckpt = load_eagle3_checkpoint(cfg.speculative_model, target_hidden_size=target.hidden_size,
                                  target_vocab_size=target.vocab_size)
    target.capture_layers(resolve_capture_layers(cfg.eagle3_layers_to_capture, ckpt.config.aux_layer_ids,
                                                 target.num_layers))
    dtype, device = target.lm_head.weight.dtype, target.lm_head.weight.device
    draft = Eagle3DraftModel.from_checkpoint(ckpt, target.num_layers, target.decoder.embed_tokens, dtype, device)
    worker = Eagle3OneModelWorker(cfg.max_draft_len, draft, use_rejection_sampling=cfg.use_rejection_sampling,
                                  tree=tree)
    worker.sa_enhancer = SADraftEnhancer(cfg.sa_spec_threshold) if cfg.use_sa_spec else None
    return worker
