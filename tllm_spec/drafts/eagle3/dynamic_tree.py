"""The EAGLE-3 worker's dynamic-tree step (``Eagle3Config(use_dynamic_tree=True, dynamic_tree_max_topK=k,
max_total_draft_tokens=N, max_draft_len=D)``): EAGLE-2's tree, grown per request from the head's own
confidence and verified like a static tree (:class:`.tree_step.TreeStep`).

Growing (device ops on fixed shapes, no host sync): a candidate's *score* is the sum of the draft's log
probabilities along its path. Depth 1 proposes the root's k children; every later depth runs the head once over
a frontier of k nodes (at depth 1 all k children, then the k highest-scoring of the previous depth's k * k
candidates) and proposes k children for each. After depth D the N highest-scoring candidates (ties: the one
created first) form the tree, numbered breadth-first (root node 0; within a depth in creation order, so siblings
stay in rank order). A child never scores above its parent, so the kept nodes are prefix-closed, and a node's
kept children are its first ones in rank order.

Sampled requests under rejection sampling draw a node's k children without replacement from the head's
distribution q at their temperature / top-k / top-p (a Gumbel top-k on their own random stream) and keep q for
verification. Their j-th child is scored with q's j-th largest probability, not with its drawn token's: the
tree's shape then depends only on distributions, never on what was drawn, which is what recursive rejection
sampling needs to stay lossless (a node whose number of children depended on their values would bias what is
emitted). For greedy requests the j-th child *is* q's j-th most likely token, so this is EAGLE-2's score.

Layout: while growing, frontier node f of depth d is written to the draft's cache at row base + 1 + (d - 1) k + f
and sees its path's rows (scratch: the next step's first pass rewrites the tree's rows); ``(D - 1) k <= N``
keeps them inside what a request reserves. The tree a slot drafted (parents, rows of its kept distributions)
stays on the device until that slot's next step verifies it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...kernels.paged_attention import TREE_WINDOW
from ...model.attention import AttentionMetadata
from ...sampling import rng, sampler
from ...sampling.rejection import full_vocab_probs
from ...sampling.small_topk import small_topk
from ..metadata import SpecMetadata
from ..tree import TreeTensors, first_child_chains, relative_tree_bits, tree_tensors
from .tree_step import _SALT_CHILDREN, TreeStep

if TYPE_CHECKING:
    from ...guided.decoder import GuidedDecoder


class DynamicTreeStep(TreeStep):
    """A dynamic tree of ``num_nodes`` drafts, ``max_depth`` deep, ``top_k`` children per expanded node
    (``Eagle3Config`` checks that ``(max_depth - 1) * top_k <= num_nodes <= top_k + (max_depth - 1) * top_k**2``,
    the candidates growing proposes)."""

    is_dynamic = True

    def __init__(self, max_depth: int, top_k: int, num_nodes: int, device: torch.device | str = "cpu"):
        if num_nodes + 1 > TREE_WINDOW:
            raise ValueError(f"a tree of {num_nodes} drafts does not fit the {TREE_WINDOW}-row tree mask")
        if num_nodes > top_k + (max_depth - 1) * top_k ** 2:
            raise ValueError(f"a dynamic tree grows fewer than {num_nodes} candidates")
        self.depth, self.top_k, self.size = max_depth, top_k, num_nodes
        self.num_parents = 1 + (max_depth - 1) * top_k  # rows of kept distributions: the root and every frontier
        self.allocate(1, device)

    def allocate(self, num_slots: int, device: torch.device | str) -> DynamicTreeStep:
        """Per-slot trees, each set to the shape a tree of equal scores takes until the slot drafts its own."""
        parents, rows = self._shape(lambda depth, chosen: torch.zeros(1, 1 if chosen is None else self.top_k,
                                                                      self.top_k, device=device))[:2]
        self.frontier_slots = torch.arange(self.top_k, device=device)  # device constants the step indexes with
        self.parents = parents.expand(max(num_slots, 1), -1).clone()  # [S, N+1]
        self.slot_prob_rows = rows.expand(max(num_slots, 1), -1).clone()  # [S, N+1]
        return self

    @property
    def num_nodes(self) -> int:
        return self.size

    @property
    def max_depth(self) -> int:
        return self.depth

    def structure(self, slots: torch.Tensor) -> tuple[TreeTensors, torch.Tensor, torch.Tensor]:
        tensors = tree_tensors(self.parents[slots], self.depth, self.top_k)
        return tensors, tensors.relative_masks(), self.slot_prob_rows[slots]

    def first_child_chain(self, slots: torch.Tensor) -> torch.Tensor:
        return first_child_chains(self.parents[slots], self.depth)

    def draft(self, draft_model, hidden: torch.Tensor, position: torch.Tensor, slots: torch.Tensor,
              attn: AttentionMetadata, spec_metadata: SpecMetadata | None = None,
              draft_probs: torch.Tensor | None = None, guided: GuidedDecoder | None = None) -> torch.Tensor:
        """Grow each request's tree from its last accepted token (hidden [B, H]: the head's output there; position
        [B]: its row; slots [B]) and keep it for the slot's next step. Returns the N drafts [B, N] in node order.
        ``draft_probs`` [slots, P, V]: sampled requests draw their children and keep each frontier's q there.
        ``guided``: the worker's GuidedDecoder, whose draft-pass mask of depth d masks the children proposed at
        depth d (a refused child scores -inf: the grammar shapes the tree)."""
        num, k = hidden.shape[0], self.top_k
        d2t = draft_model.vocab_offsets
        outputs = hidden[:, None]  # [B, F, H]: the head's output at each frontier node
        visible = torch.zeros(num, 1, self.num_parents, dtype=torch.bool, device=hidden.device)
        visible[:, :, 0] = True  # [B, F, R]: the draft rows each frontier node sees (its path's)
        frontier_rows = [0]
        tokens: list[torch.Tensor] = []

        def expand(depth: int, chosen: torch.Tensor | None) -> torch.Tensor:
            nonlocal outputs, visible, frontier_rows
            if chosen is not None:  # [B, k]: the frontier, positions among the last depth's candidates
                parent_slot = chosen // k
                ids = tokens[-1].flatten(1).gather(1, chosen)
                frontier_rows = [1 + (depth - 2) * k + f for f in range(k)]
                own = 1 + (depth - 2) * k + self.frontier_slots  # [k]: their draft rows (no host tensor)
                visible = visible.gather(1, parent_slot[..., None].expand(-1, -1, visible.shape[-1])).clone()
                visible[:, self.frontier_slots, own] = visible.new_ones(())  # a device value: a host True is
                # copied to the GPU, which a CUDA graph capture of the eager step refuses
                meta = AttentionMetadata(attn.kv_cache, (position[:, None] + own).flatten(),
                                         slots.repeat_interleave(k), attn.max_kv_len, tokens_per_request=k,
                                         rope_positions=(position[:, None] + depth - 1).expand(num, k).flatten(),
                                         tree_mask=relative_tree_bits(visible, own).flatten())
                inputs = outputs.gather(1, parent_slot[..., None].expand(-1, -1, outputs.shape[-1]))
                outputs = draft_model(ids.flatten(), inputs.flatten(0, 1), meta).view(num, k, -1)
            logits = draft_model.compute_logits(outputs)  # [B, F, V_draft]
            if guided is not None:
                for f in range(logits.shape[1]):
                    guided.execute_draft_batch(logits[:, f], d2t, depth - 1)
            children, scores = self._children(logits, frontier_rows, d2t, spec_metadata, draft_probs, slots)
            tokens.append(children if d2t is None else children + d2t[children])
            return scores

        parents, rows, keep = self._shape(expand)
        self.parents[slots], self.slot_prob_rows[slots] = parents, rows
        every = torch.cat([t.flatten(1) for t in tokens], dim=1)  # [B, C]: candidates after the root
        return every.gather(1, keep[:, 1:] - 1)

    def _shape(self, expand) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Grow trees over candidate scores: ``expand(depth, chosen)`` (chosen [B, k]: the frontier, positions
        among the last depth's candidates; None at depth 1: the root) returns the slot scores [B, F, k] of each
        frontier node's children (log probabilities, rank order). Returns (parents [B, N+1] and rows of
        the kept distributions [B, N+1] in node order; keep [B, N+1]: each node's candidate id, the root 0)."""
        k = self.top_k
        frontier_score = frontier_id = chosen = None
        ids = 1
        scores, parent_ids, frontier_ids = [], [], []
        for depth in range(1, self.depth + 1):
            slot_scores = expand(depth, chosen).clamp(max=0)  # a child never above its parent (float rounding)
            batch = slot_scores.shape[0]
            if depth == 1:
                frontier_score = slot_scores.new_zeros(batch, 1)
                frontier_id = torch.zeros(batch, 1, dtype=torch.int64, device=slot_scores.device)
            score = (frontier_score[..., None] + slot_scores).flatten(1)  # [B, F*k]
            scores.append(score)
            parent_ids.append(frontier_id.repeat_interleave(k, dim=1))
            if depth < self.depth:  # the next frontier: the k best of this depth (ties: created first)
                chosen = score.sort(dim=1, descending=True, stable=True).indices[:, :k].sort(dim=1).values
                frontier_score = score.gather(1, chosen)
                frontier_id = ids + chosen
                frontier_ids.append(frontier_id)
            ids += score.shape[1]
        batch, device = scores[0].shape[0], scores[0].device
        root = torch.full((batch, 1), torch.inf, device=device)
        every = torch.cat([root, *scores], dim=1)  # [B, C+1]
        keep = every.sort(dim=1, descending=True, stable=True).indices[:, :self.size + 1].sort(dim=1).values
        parent_of = torch.cat([torch.zeros(batch, 1, dtype=torch.int64, device=device), *parent_ids], dim=1)
        node_of = torch.full_like(parent_of, -1).scatter(1, keep, torch.arange(self.size + 1, device=device)
                                                         .expand(batch, -1))
        rows_of = torch.full_like(parent_of, -1)
        rows_of[:, 0] = 0
        for depth, frontier in enumerate(frontier_ids, start=1):
            rows_of.scatter_(1, frontier, (1 + (depth - 1) * k + torch.arange(k, device=device)).expand(batch, -1))
        return node_of.gather(1, parent_of.gather(1, keep)), rows_of.gather(1, keep), keep

    def _children(self, logits: torch.Tensor, frontier_rows: list[int], d2t: torch.Tensor | None,
                  spec_metadata: SpecMetadata | None, draft_probs: torch.Tensor | None, slots: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each frontier node's k children in the draft vocabulary and their slot scores, [B, F, k] each:
        greedy (and without ``draft_probs``) the k most likely tokens and their log probabilities; sampled
        requests k draws without replacement from q (their own stream per frontier row), scored by q's k
        largest log probabilities, q kept at the node's row of ``draft_probs``."""
        k = self.top_k
        ranked_scores, ranked = small_topk(logits.float().log_softmax(-1), k)
        if draft_probs is None:
            return ranked, ranked_scores
        num, width, vocab = logits.shape
        temps, top_ks, top_ps = (x[spec_metadata.first_rows()].repeat_interleave(width)
                                 for x in spec_metadata.rows())
        q = sampler.target_probs(logits.flatten(0, 1), temps, top_ks, top_ps).view(num, width, vocab)
        gumbel = torch.empty_like(q)
        for f, row in enumerate(frontier_rows):
            seed, offset = spec_metadata.draft_streams(row)
            uniform = rng.uniform(seed, offset, (num, vocab), salt=_SALT_CHILDREN)
            if not spec_metadata.has_request_seeds:
                rng.advance(seed)  # the batch stream moves on after a draw (per-request streams already have)
            gumbel[:, f] = -torch.log(-torch.log(uniform))
            draft_probs[slots, row] = full_vocab_probs(q[:, f], d2t, draft_probs.shape[-1])
        drawn = small_topk(q.log() + gumbel, k)[1]
        sampled_scores = slot_scores(q, k)
        greedy = (top_ks.view(num, width) == 1)[..., None]
        return torch.where(greedy, ranked, drawn), torch.where(greedy, ranked_scores, sampled_scores)


def slot_scores(q: torch.Tensor, top_k: int) -> torch.Tensor:
    """[..., k]: the scores of a node's k child slots under distribution q [..., V], whatever tokens fill them:
    q's k largest log probabilities (the rule that keeps a sampled dynamic tree lossless)."""
    return small_topk(q, top_k)[0].log()
