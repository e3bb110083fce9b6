"""Verifying a draft tree (one for every request or one per request, :class:`.tree.TreeTensors`), as device-tensor
ops (no host sync).

Verification of one step: the target scores the root and every node; node i's draft is accepted when it equals
the target's token at its parent and its parent is accepted; the step keeps the deepest accepted node's path
(the first in node order among equally deep ones), whose tokens are the target's at each node of the path (the
last one is the bonus token). A chain of K drafts is the tree ``[[0], [0, 0], ...]``, and there this is exactly
strict acceptance.

Tree tokens are written to the cache at rows base + node index (nodes of one depth share a RoPE position,
base + depth, but not a row); after acceptance the path's rows are moved to base + depth
(:func:`path_rows`, :mod:`..kernels.move_rows`), so the committed cache is what a chain would have left.
"""
from __future__ import annotations

import torch

from ..kernels.move_rows import move_rows_ref
from ..sampling import rng
from .tree import DraftTree, TreeTensors

_SALT_TREE_ACCEPT, _SALT_TREE_DRAW = 0x7EE1, 0x7EE2


def tree_greedy_accept(tree: TreeTensors, draft_tokens: torch.Tensor, target_tokens: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification of a tree per request (one tree for all, or one each): the deepest path whose every
    draft equals the target's token at its parent (the first in node order among equally deep ones).

    draft_tokens [B, N] (node i's draft in column i - 1); target_tokens [B, N+1] (the target's token after the
    root and after each node). Returns (num_accepted [B] int64: the path's nodes including the root, i.e. the
    tokens emitted with the bonus; path [B, D+1] int64: its node indices from the root, padded with its last
    node; tokens [B, D+1] int64: the target's token at each path node, the first num_accepted valid)."""
    num_requests = draft_tokens.shape[0]
    tree = tree.batched(num_requests)
    parent_tokens = target_tokens.gather(1, tree.parents[:, 1:])  # [B, N]
    mismatch = torch.cat([draft_tokens.new_zeros(num_requests, 1, dtype=torch.bool), draft_tokens != parent_tokens],
                         dim=1)  # [B, N+1]; the root always matches
    broken = (tree.ancestors & mismatch[:, None, :]).any(-1)  # [B, N+1]: a mismatch on the node's path
    return _first_deepest(tree, ~broken, target_tokens)


def _first_deepest(tree: TreeTensors, allowed: torch.Tensor, target_tokens: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(num_accepted, path, tokens) of the deepest allowed node per request (the first in node order among
    equally deep ones); tree batched, allowed [B, N+1] bool (the root always)."""
    num_nodes = tree.num_nodes + 1
    order = num_nodes - 1 - torch.arange(num_nodes, device=allowed.device)
    best = torch.where(allowed, tree.depths * num_nodes + order, -1).argmax(dim=1, keepdim=True)  # [B, 1]
    path = tree.paths.gather(1, best[:, :, None].expand(-1, 1, tree.paths.shape[-1]))[:, 0]  # [B, D+1]
    return tree.depths.gather(1, best)[:, 0] + 1, path, target_tokens.gather(1, path)


def forced_tree_path(tree: TreeTensors, num_accepted: torch.Tensor) -> torch.Tensor:
    """The path a forced acceptance of ``num_accepted`` [B] tokens takes (TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS
    on a tree): the first node in node order as deep as asked (or the deepest there is), i.e. the most likely
    child at every depth where that chain goes deep enough. Returns the path [B, D+1] of node indices (padded
    with its last node)."""
    tree = tree.batched(num_accepted.shape[0])
    allowed = tree.depths <= (num_accepted - 1)[:, None]
    return _first_deepest(tree, allowed, tree.depths)[1]


def path_rows(block_tables: torch.Tensor, slots: torch.Tensor, base: torch.Tensor, path: torch.Tensor,
              num_accepted: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cache rows (page * page_size + offset) of the accepted paths' move: path node j of request b (row
    base[b] + path[b, j]) goes to row base[b] + j for j < num_accepted[b]; rows not kept are written back onto
    themselves (fixed shapes). block_tables [S, P] int32; slots, base, num_accepted [B] int64; path [B, D+1] int64
    -> (src, dst) [B * (D+1)] int64, the same for every layer."""
    width = path.shape[1]
    offsets = torch.arange(width, device=path.device)
    keep = offsets[None, :] < num_accepted[:, None]  # [B, D+1]
    src = base[:, None] + path
    dst = torch.where(keep, base[:, None] + offsets[None, :], src)
    table = block_tables[slots].long()  # [B, P]

    def flat(rows: torch.Tensor) -> torch.Tensor:
        return table.gather(1, rows // page_size) * page_size + rows % page_size
    return flat(src).flatten(), flat(dst).flatten()


def compact_path_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, slots: torch.Tensor,
                    base: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """Move the accepted path's K/V rows into place in one layer's paged cache (:func:`path_rows`, then
    :func:`..kernels.move_rows.move_rows_ref`; a step computes the rows once and moves every layer's in one
    launch)."""
    src, dst = path_rows(block_tables, slots, base, path, num_accepted, k_cache.shape[1])
    move_rows_ref([k_cache, v_cache], None, src, dst, path.shape[1])


def tree_rejection_sample(tree: DraftTree | TreeTensors, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                          draft_tokens: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
                          prob_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless verification of sampled tree drafts (recursive rejection sampling without replacement, the
    multi-draft rule of SpecInfer / EAGLE-2 sampling): the emitted tokens are distributed as the target's own.

    Each node's children must have been drawn one after the other *without replacement* from the draft's
    distribution at that node (the first from q, the next from q without the first, renormalised, ...; e.g. a
    Gumbel top-k), and how many of them the tree keeps must not depend on what the drawn tokens are (a static
    tree; a dynamic tree whose shape is chosen from the draft's distributions, not from the draws). From the
    root: child c (in rank order) is accepted with probability min(1, p(x_c) / q(x_c)); on a rejection p becomes
    norm(max(p - q, 0)) (p stays where that leaves no mass: p equals q to rounding) and q loses x_c
    (renormalised); the first accepted child becomes the node and verification goes on below it; when every
    child is rejected a token is drawn from the last p and the step ends; a leaf reached emits a bonus token
    drawn from its target distribution. A child whose token q gives no mass (drawn after q's support ran out: a
    Gumbel top-k wider than the support) is skipped, as if it had not been drawn.

    tree: one for every request or one each (batched :class:`TreeTensors`); target_probs [B, N+1, V] (the
    target's next-token distribution at the root and at every node); draft_probs [B, P, V] (the draft's at each
    node with children, row ``prob_rows[node]`` ([N+1] or [B, N+1]); default P = N+1, row = node); draft_tokens
    [B, N]. seed, offset: [1] int64 (the batch stream, advanced in place) or [B] (per-request streams). Returns
    (num_accepted [B]: tokens emitted, the last one drawn; tokens [B, D+1], the first num_accepted valid; path
    [B, D+1]: the accepted nodes from the root, padded with the last). Device ops, no host sync (one loop per
    depth and child rank)."""
    num_requests = target_probs.shape[0]
    device = target_probs.device
    if isinstance(tree, DraftTree):
        tree = tree.tensors(device)
    tree = tree.batched(num_requests)
    rows = torch.arange(num_requests, device=device)
    if prob_rows is None:
        prob_rows = torch.arange(tree.num_nodes + 1, device=device)
    prob_rows = prob_rows.expand(num_requests, tree.num_nodes + 1)
    node = torch.zeros(num_requests, dtype=torch.int64, device=device)
    alive = torch.ones(num_requests, dtype=torch.bool, device=device)
    depths = tree.max_depth + 1
    tokens = torch.zeros(num_requests, depths, dtype=torch.int64, device=device)
    path = torch.zeros(num_requests, depths, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(num_requests, dtype=torch.int64, device=device)
    width = tree.children.shape[-1]
    draws = rng.uniform(seed, offset, (num_requests, depths * width + 1), salt=_SALT_TREE_ACCEPT)
    noise = -torch.log(rng.uniform(seed, offset, (num_requests, target_probs.shape[-1]), salt=_SALT_TREE_DRAW))
    ending_p = torch.zeros_like(target_probs[:, 0])
    for depth in range(depths):
        p = target_probs[rows, node]  # [B, V]
        q = draft_probs[rows, prob_rows[rows, node].clamp(min=0)]  # a leaf's row is never read: it has no children
        moved = torch.zeros(num_requests, dtype=torch.bool, device=device)
        next_node = node
        for rank in range(width):
            child = tree.children[rows, node, rank]  # [B]
            x = draft_tokens[rows, (child - 1).clamp(min=0)]  # [B]
            p_x, q_x = p[rows, x], q[rows, x]
            trying = alive & ~moved & (child >= 0) & (q_x > 0)
            accept = trying & (draws[:, depth * width + rank] * q_x < p_x)  # u < p / q
            moved |= accept
            next_node = torch.where(accept, child, next_node)
            tokens[:, depth] = torch.where(accept, x, tokens[:, depth])
            reject = (trying & ~accept)[:, None]
            residual = (p - q).clamp(min=0)
            mass = residual.sum(-1, keepdim=True)  # 0 only where p == q to rounding: p stays
            p = torch.where(reject & (mass > 0), residual / mass.clamp(min=1e-30), p)
            q_without = q.scatter(1, x[:, None], 0.0)
            q = torch.where(reject, q_without / q_without.sum(-1, keepdim=True).clamp(min=1e-30), q)
        ending = alive & ~moved  # every child rejected, or a leaf: draw from what p has become
        ending_p = torch.where(ending[:, None], p, ending_p)
        num_accepted = torch.where(ending, depth + 1, num_accepted)
        alive &= moved
        node = next_node
        if depth + 1 < depths:
            path[:, depth + 1] = node
    last = (num_accepted - 1)[:, None]
    drawn = (ending_p / noise).argmax(-1)  # exponential race: a draw from ending_p / its sum
    tokens = tokens.scatter(1, last, drawn[:, None])
    rng.advance(seed)
    return num_accepted, tokens, path
