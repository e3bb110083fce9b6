"""The EAGLE-3 worker's static-tree step (``Eagle3Config(eagle_choices=...)``): verify a tree of N drafts, move the
accepted path's K/V into place, and draft the next tree with one head pass per depth.

Layout: a generation request's run is its last accepted token (the root) and the N nodes in breadth-first order
(:mod:`..tree`), at cache rows base .. base + N, rotated by base + depth, each seeing its own path
(``AttentionMetadata.rope_positions`` / ``tree_mask``, set by the runner). Acceptance: the deepest path whose
drafts equal the target's token at their parents (:func:`tree_greedy_accept`), which is lossless at any
temperature (each node's token is the target's own draw given its path; a child is followed only when it is that
draw). Drafting: the children of a node are its head distribution's top tokens by rank; depth d's nodes with
children go through the head together, at rows base' + index, rotated by base' + d.

With rejection sampling (``use_rejection_sampling``), a sampled request's children are drawn without replacement
from the head's distribution at its temperature / top-k / top-p (a Gumbel top-k on the request's own random
stream), that distribution is kept per request and node with children, and the next step verifies the tree by
recursive rejection sampling (:func:`tree_rejection_sample`): lossless, and more drafts survive than strict
acceptance lets through. Greedy requests keep the ranked children and the greedy path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ...kernels.move_rows import move_rows
from ...model.attention import AttentionMetadata
from ...model.kv_cache import KVCache
from ...sampling import rng, sampler
from ...sampling.forcing import forced_num_accepted
from ...sampling.rejection import full_vocab_probs
from ...sampling.small_topk import small_topk
from ..base import with_context_rows
from ..metadata import SpecMetadata
from ..tree import DraftTree, TreeTensors, first_child_chains, parent_rows, tree_children
from ..tree_verify import forced_tree_path, path_rows, tree_greedy_accept, tree_rejection_sample

if TYPE_CHECKING:
    from ...guided.decoder import GuidedDecoder

ALL_VISIBLE = (1 << 63) - 1  # a tree mask that hides nothing (a prompt token's or a chain's)
_SALT_CHILDREN = 0xC41D  # the Gumbel noise of a sampled request's children


class TreeStep:
    """A static tree on one device: its structure tensors and the per-token masks of a verify run."""

    is_dynamic = False

    def __init__(self, tree: DraftTree, device: torch.device | str = "cpu"):
        self.tree = tree
        self.allocate(0, device)

    def allocate(self, num_slots: int, device: torch.device | str) -> TreeStep:
        """Put the tree's tensors on ``device`` (a static tree keeps nothing per slot)."""
        self.tensors: TreeTensors = self.tree.tensors(device)
        self.masks = self.tensors.relative_masks()  # [N+1] int64
        self.host_prob_rows = parent_rows(self.tree)  # row of a node's kept draft distribution (indexing with
        self.prob_rows = torch.tensor(self.host_prob_rows, device=device)  # a host int: no sync in the step)
        rows = self.host_prob_rows
        self.num_parents = max(rows) + 1
        children = tree_children(self.tree.parents)
        self.proposals = [_Proposal.of(self.tree, children, depth, device) for depth in range(self.tree.max_depth)]
        # per depth from 1: the nodes with children (that depth's parents; one head pass each), listed and on the device
        self.frontiers = [(nodes, torch.tensor(nodes, device=device)) for nodes in
                          ([node for node, _ in plan.parents] for plan in self.proposals[1:])]
        return self

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    @property
    def max_depth(self) -> int:
        return self.tree.max_depth

    def structure(self, slots: torch.Tensor) -> tuple[TreeTensors, torch.Tensor, torch.Tensor]:
        """(tree tensors, tree masks [N+1], rows of the kept draft distributions [N+1]) of the trees the
        requests in ``slots`` [G] verify: here the one static tree, unbatched."""
        return self.tensors, self.masks, self.prob_rows

    def first_child_chain(self, slots: torch.Tensor) -> torch.Tensor:
        """[B, D] node indices of the chain of first children of each request's tree (0 past its end): where
        suffix drafting puts its chain (``use_sa_spec``). slots [B]."""
        return first_child_chains(self.tensors.parents[None], self.max_depth).expand(slots.shape[0], -1)

    def verify_metadata(self, attn: AttentionMetadata, num_context_tokens: int, num_generation: int
                        ) -> AttentionMetadata:
        """``attn`` of a step whose generation runs are trees: their tokens rotated by root + depth and masked to
        their paths (prompt tokens unchanged)."""
        if not num_generation:
            return attn
        size = self.num_nodes + 1
        tensors, masks, _ = self.structure(attn.token_slots[num_context_tokens::size][:num_generation])
        runs = attn.positions[num_context_tokens:].view(num_generation, size)
        rope = torch.cat([attn.positions[:num_context_tokens], (runs[:, :1] + tensors.depths).flatten()])
        masks = torch.cat([torch.full((num_context_tokens,), ALL_VISIBLE, dtype=torch.int64, device=rope.device),
                           masks.expand(num_generation, size).flatten()])
        return attn.with_tree(rope, masks)

    def accept(self, target_tokens: torch.Tensor, draft_tokens: torch.Tensor, num_contexts: int,
               spec_metadata: SpecMetadata, forced: torch.Tensor | None, gen_slots: torch.Tensor,
               sampled: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(new_tokens [B, N+1] (the accepted path's tokens first), num_accepted [B], paths [B, D+1] (node indices
        of each request's accepted path; a prompt's: the root)). ``forced``: the forced count (a 0-dim tensor),
        taken along the most likely children. gen_slots [G]: the generation requests' slots. ``sampled``: (the
        generation rows' target logits [G*(N+1), V], the draft distributions kept for their trees [G, P, V]) to
        verify sampled requests by rejection sampling."""
        num_gen, n = draft_tokens.shape
        tensors, _, prob_rows = self.structure(gen_slots)
        tensors = tensors.batched(num_gen)
        gen_targets = target_tokens[num_contexts:].view(num_gen, n + 1)
        num, path, tokens = tree_greedy_accept(tensors, draft_tokens, gen_targets)
        if sampled is not None and num_gen:
            num, path, tokens = self._rejection_sample(tensors, prob_rows, draft_tokens, spec_metadata, *sampled,
                                                       (num, path, tokens))
        if forced is not None:
            path = forced_tree_path(tensors, forced_num_accepted(forced, n, num_gen, spec_metadata.seed,
                                                                 spec_metadata.offset))
            num, tokens = tensors.depths.gather(1, path[:, -1:])[:, 0] + 1, gen_targets.gather(1, path)
        new_tokens, num_accepted = with_context_rows(target_tokens, num_contexts,
                                                     F.pad(tokens, (0, n + 1 - tokens.shape[1])), num)
        return new_tokens, num_accepted, torch.cat([path.new_zeros(num_contexts, path.shape[1]), path])

    @staticmethod
    def _rejection_sample(tensors: TreeTensors, prob_rows: torch.Tensor, draft_tokens: torch.Tensor,
                          spec_metadata: SpecMetadata, gen_logits: torch.Tensor, draft_probs: torch.Tensor,
                          greedy_result: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sampled requests verified by :func:`tree_rejection_sample`; greedy ones (top-k 1) keep ``greedy_result``
        (num [G], path [G, D+1], tokens [G, D+1])."""
        num_gen, n = draft_tokens.shape
        temps, top_ks, top_ps = (x[spec_metadata.num_context_requests:] for x in spec_metadata.rows())
        probs = sampler.target_probs(gen_logits, temps, top_ks, top_ps).view(num_gen, n + 1, -1)
        seed, offset = spec_metadata.generation_streams()
        sampled = tree_rejection_sample(tensors, probs, draft_probs, draft_tokens, seed, offset, prob_rows)
        greedy = top_ks.view(num_gen, n + 1)[:, 0] == 1
        num, path, tokens = greedy_result
        return (torch.where(greedy, num, sampled[0]), torch.where(greedy[:, None], path, sampled[2]),
                torch.where(greedy[:, None], tokens, sampled[1]))

    @staticmethod
    def compact(kv: KVCache, attn: AttentionMetadata, root_tokens: torch.Tensor, paths: torch.Tensor,
                num_accepted: torch.Tensor) -> None:
        """Move each generation request's accepted path into rows root .. root + n - 1, in every layer (the
        target's and the draft's). root_tokens [G] flat index of each run's root; paths [G, D+1]; num [G]."""
        slots, base = attn.token_slots[root_tokens], attn.positions[root_tokens]
        src, dst = path_rows(kv.block_tables, slots, base, paths, num_accepted, kv.page_size)  # once, all layers
        move = torch.ops.tllm_spec.move_cache_rows if torch.compiler.is_compiling() else move_rows
        for caches, table in kv.row_groups:  # one launch per cache shape (one, where the head's matches)
            move(caches, table, src, dst, paths.shape[1])

    def draft(self, draft_model, hidden: torch.Tensor, position: torch.Tensor, slots: torch.Tensor,
              attn: AttentionMetadata, spec_metadata: SpecMetadata | None = None,
              draft_probs: torch.Tensor | None = None, guided: GuidedDecoder | None = None) -> torch.Tensor:
        """The next tree from each request's last accepted token: hidden [B, H] (the head's output there),
        position [B] (its row), slots [B]. Returns the N drafts [B, N] in node order. ``draft_probs``
        [slots, P, V] (rejection sampling, a step with sampled requests): sampled requests draw their children
        (:meth:`_children`) and keep each node's distribution there. ``guided``: the worker's GuidedDecoder, whose
        draft-pass mask of depth d masks the children of the nodes at depth d. Each depth's children are proposed
        together (one top-k over its parents' logits, one write of their tokens), so the launches grow with the
        depth, not with the nodes."""
        tree = self.tree
        parents = tree.parents
        num = hidden.shape[0]
        drafts = torch.empty(num, tree.num_nodes, dtype=torch.int64, device=hidden.device)
        outputs = {0: hidden}
        sampling = None
        if draft_probs is not None:
            temps, top_ks, top_ps = (x[spec_metadata.first_rows()] for x in spec_metadata.rows())
            sampling = (temps, top_ks, top_ps, spec_metadata, draft_probs, slots)

        def propose(depth: int, logits: torch.Tensor) -> None:  # logits [B, P, V_draft]: depth's parents
            plan, d2t = self.proposals[depth], draft_model.vocab_offsets
            if guided is not None:
                for i in range(logits.shape[1]):  # the depth's mask for every parent (views: masked in place)
                    guided.execute_draft_batch(logits[:, i], d2t, depth)
            ids = small_topk(logits, plan.top)[1].flatten(1)[:, plan.picks]  # greedy: children by rank
            if sampling is not None:  # a sampled request's j-th child is its j-th draw, whatever its rank
                drawn = torch.cat([self._children(logits[:, i], count, node, d2t, *sampling)
                                   for i, (node, count) in enumerate(plan.parents)], dim=1)
                ids = torch.where(sampling[1][:, None] == 1, ids, drawn)
            drafts[:, plan.first - 1:plan.last] = ids if d2t is None else ids + d2t[ids]

        propose(0, draft_model.compute_logits(hidden)[:, None])
        for depth, (frontier, index) in enumerate(self.frontiers, start=1):
            if not frontier:
                break
            width = len(frontier)
            rows = (position[:, None] + index).flatten()
            meta = AttentionMetadata(attn.kv_cache, rows, slots.repeat_interleave(width), attn.max_kv_len,
                                     tokens_per_request=width,
                                     rope_positions=(position[:, None] + depth).expand(num, width).flatten(),
                                     tree_mask=self.masks[index].repeat(num))
            inputs = torch.stack([outputs[parents[n]] for n in frontier], dim=1).flatten(0, 1)
            out = draft_model(drafts[:, index - 1].flatten(), inputs, meta).view(num, width, -1)
            for j, node in enumerate(frontier):
                outputs[node] = out[:, j]
            # the frontier is the depth's parents (self.proposals[depth].parents): one lm_head read for them all
            propose(depth, draft_model.compute_logits(out.flatten(0, 1)).view(num, width, -1))
        return drafts

    def _children(self, logits: torch.Tensor, num_children: int, node: int, d2t: torch.Tensor | None,
                  temps: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, spec_metadata: SpecMetadata,
                  draft_probs: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """A node's children for sampled requests, in the draft vocabulary [B, num_children]: draws one after the
        other without replacement from the head's distribution q at the request's temperature / top-k / top-p
        (Gumbel top-k: the largest log q + Gumbel noise, from the request's stream for this node; consecutive
        draws even where the tree's ranks skip one, as rejection sampling needs), q kept in ``draft_probs``
        (target vocabulary) for the next step's verification. (Greedy requests' rows are not used.)"""
        q = sampler.target_probs(logits, temps, top_ks, top_ps)  # [B, V_draft]
        seed, offset = spec_metadata.draft_streams(node)
        uniform = rng.uniform(seed, offset, tuple(q.shape), salt=_SALT_CHILDREN)
        if not spec_metadata.has_request_seeds:
            rng.advance(seed)  # the batch stream moves on after a draw (per-request streams already have)
        draft_probs[slots, self.host_prob_rows[node]] = full_vocab_probs(q, d2t, draft_probs.shape[-1])
        return small_topk(q.log() - torch.log(-torch.log(uniform)), num_children)[1]


@dataclass(frozen=True)
class _Proposal:
    """How one depth's parents propose the next depth's nodes (``first`` .. ``last``, contiguous in breadth-first
    order, grouped by parent in parent order, siblings by rank): ``parents`` [(node, number of children)] in node
    order (the nodes of the depth with children); ``top``: the top-k the greedy children need (the largest rank
    + 1); ``picks`` [last - first + 1]: each child's column in the parents' flattened top-k
    (parent index * top + rank)."""

    parents: tuple[tuple[int, int], ...]
    top: int
    picks: torch.Tensor
    first: int
    last: int

    @classmethod
    def of(cls, tree: DraftTree, children: list[list[int]], depth: int, device: torch.device | str) -> _Proposal:
        parents = [n for n in tree.nodes_at_depth(depth) if children[n]]
        kids = [(i, kid) for i, node in enumerate(parents) for kid in children[node]]
        top = max(tree.ranks[kid] for _, kid in kids) + 1
        picks = torch.tensor([i * top + tree.ranks[kid] for i, kid in kids], dtype=torch.int64, device=device)
        assert [kid for _, kid in kids] == tree.nodes_at_depth(depth + 1)  # breadth-first: contiguous
        return cls(tuple((n, len(children[n])) for n in parents), top, picks, kids[0][1], kids[-1][1])
