"""Draft trees: the structure of an EAGLE tree and its verification, as device-tensor ops (no host sync). A static
tree (:class:`DraftTree`) is one for every request; a dynamic one (``eagle3/dynamic_tree.py``) is one per request,
given by its parents (:func:`tree_tensors`); verification takes either.

A tree is given as TensorRT-LLM's ``eagle_choices``: one path per node, the top-k rank taken at each depth from
the root, e.g. ``[[0], [1], [0, 0], [0, 1], [1, 0]]`` (the root is the last accepted token; ``[0, 1]`` is the
second most likely child of the most likely first draft). Nodes are numbered breadth-first with the root as node
0, so a node's index is never below its depth and a parent's index is below its children's.

Verification of one step: the target scores the root and every node; node i's draft is accepted when it equals
the target's token at its parent and its parent is accepted; the step keeps the deepest accepted node's path
(the first in node order among equally deep ones), whose tokens are the target's at each node of the path (the
last one is the bonus token). A chain of K drafts is the tree ``[[0], [0, 0], ...]``, and there this is exactly
strict acceptance.

Tree tokens are written to the cache at rows base + node index (nodes of one depth share a RoPE position,
base + depth, but not a row); after acceptance the path's rows are moved to base + depth
(:func:`compact_path_kv`), so the committed cache is what a chain would have left.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..sampling import rng

_SALT_TREE_ACCEPT, _SALT_TREE_DRAW = 0x7EE1, 0x7EE2

# The default tree for batch 1 (25 drafts, 7 deep): the most likely chain, its first three alternatives at depth 1
# and second-best children along it. Chosen on the demo pair's held-out prompts at T=0 (8 prompts x 64 tokens):
# 5.71 tokens a step, against 3.23 for a chain of 3 and 4.51 for a chain of 6.
DEFAULT_EAGLE_CHOICES = (
    [[0] * d for d in range(1, 8)]
    + [[1], [2], [3], [0, 1], [0, 2], [1, 0], [2, 0], [1, 1], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 2],
       [0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 0, 0, 1], [0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 1]])


@dataclass(frozen=True)
class DraftTree:
    """A static tree of ``num_nodes`` drafts (the root, node 0, not counted) up to ``max_depth`` deep.

    Host structure (lists), plus :meth:`tensors` for the step: parents, depths, ranks [N+1] and the
    ancestor-or-self mask [N+1, N+1] (row i: the nodes on i's path from the root), and each node's path
    [N+1, D+1] (node indices from the root, padded with the node itself)."""

    choices: tuple[tuple[int, ...], ...]  # breadth-first node order; node i + 1 is choices[i]

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> DraftTree:
        """Validate ``eagle_choices`` and order them breadth-first (depth, then path). Raises ValueError naming
        the first problem: an empty or repeated path, a negative rank, a path whose parent is missing (the
        choices must be prefix-closed)."""
        paths = [tuple(int(r) for r in c) for c in choices]
        if not paths:
            raise ValueError("eagle_choices must name at least one node")
        seen: set[tuple[int, ...]] = set()
        for path in paths:
            if not path:
                raise ValueError("eagle_choices: an empty path (the root is implicit)")
            if min(path) < 0:
                raise ValueError(f"eagle_choices: negative top-k rank in {list(path)}")
            if path in seen:
                raise ValueError(f"eagle_choices: {list(path)} appears twice")
            seen.add(path)
        for path in paths:
            if len(path) > 1 and path[:-1] not in seen:
                raise ValueError(f"eagle_choices must be prefix-closed: {list(path)} has no parent "
                                 f"{list(path[:-1])}")
        return cls(tuple(sorted(paths, key=lambda p: (len(p), p))))

    @classmethod
    def chain(cls, depth: int) -> DraftTree:
        """The chain of ``depth`` drafts (each the most likely child of the one before)."""
        return cls.from_choices([[0] * d for d in range(1, depth + 1)])

    @property
    def num_nodes(self) -> int:
        """Draft tokens in the tree (TensorRT-LLM's max_total_draft_tokens for a static tree)."""
        return len(self.choices)

    @property
    def max_depth(self) -> int:
        """The longest path (TensorRT-LLM's max_draft_len)."""
        return max(len(c) for c in self.choices)

    @property
    def is_chain(self) -> bool:
        return self.num_nodes == self.max_depth

    @property
    def parents(self) -> list[int]:
        """[N+1]: each node's parent (the root's: 0)."""
        index = {c: i + 1 for i, c in enumerate(self.choices)}
        return [0] + [index.get(c[:-1], 0) for c in self.choices]

    @property
    def depths(self) -> list[int]:
        return [0] + [len(c) for c in self.choices]

    @property
    def ranks(self) -> list[int]:
        """[N+1]: the top-k rank of each node among its parent's draft distribution (the root's: 0)."""
        return [0] + [c[-1] for c in self.choices]

    def paths(self) -> list[list[int]]:
        """[N+1] lists: each node's path of node indices from the root (root first, the node last)."""
        parents, out = self.parents, [[0]]
        for i in range(1, self.num_nodes + 1):
            out.append(out[parents[i]] + [i])
        return out

    def nodes_at_depth(self, depth: int) -> list[int]:
        return [i for i, d in enumerate(self.depths) if d == depth]

    def tensors(self, device: torch.device | str = "cpu") -> TreeTensors:
        parents = torch.tensor(self.parents, dtype=torch.int64, device=device)
        return tree_tensors(parents[None], self.max_depth, max(map(len, tree_children(self))))[0]


@dataclass(frozen=True)
class TreeTensors:
    """A tree on the device, one shared by every request (unbatched fields) or one per request (a leading batch
    dimension B): parents, depths [N+1] int64; ancestors [N+1, N+1] bool (ancestor-or-self: row i holds the nodes
    on i's path); paths [N+1, D+1] int64 (node indices from the root, padded with the node); children [N+1, W]
    int64 (each node's children in rank order, -1 past the last)."""

    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    paths: torch.Tensor
    children: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[-1] - 1

    @property
    def max_depth(self) -> int:
        return self.paths.shape[-1] - 1

    def __getitem__(self, index) -> TreeTensors:
        return TreeTensors(*(x[index] for x in vars(self).values()))

    def batched(self, num: int) -> TreeTensors:
        """One tree per request: a shared tree expanded (views) to ``num`` requests; a batched one as it is."""
        if self.parents.dim() == 2:
            return self
        return TreeTensors(*(x.expand(num, *x.shape) for x in vars(self).values()))

    def relative_masks(self) -> torch.Tensor:
        """[..., N+1] int64: each tree token's visibility as paged attention takes it (``tree_mask``): bit j lets
        the token at cache row base + i see the row j below its own, i.e. its ancestors (i - a), itself (0) and
        everything below the root (j > i). Needs N + 1 <= TREE_WINDOW."""
        nodes = torch.arange(self.num_nodes + 1, device=self.ancestors.device)
        return relative_tree_bits(self.ancestors, nodes)


def relative_tree_bits(visible_rows: torch.Tensor, own_rows: torch.Tensor) -> torch.Tensor:
    """Tree tokens' attention masks in paged attention's relative form: visible_rows [..., R] bool (which of the
    tree's rows base + 0 .. base + R - 1 the token sees), own_rows [...] int64 (the token's own row) -> [...]
    int64, bit j set where the row j below the token's own is visible or lies below the tree (row < base)."""
    from ..kernels.paged_attention import TREE_WINDOW

    if visible_rows.shape[-1] > TREE_WINDOW:
        raise ValueError(f"a tree of {visible_rows.shape[-1] - 1} drafts does not fit the {TREE_WINDOW}-row tree "
                         f"mask")
    offsets = torch.arange(TREE_WINDOW, device=visible_rows.device)
    rows = own_rows.expand(visible_rows.shape[:-1])[..., None] - offsets  # [..., W]: the row j below
    seen = visible_rows.gather(-1, rows.clamp(min=0)) | (rows < 0)
    return (seen.to(torch.int64) << offsets).sum(-1)


def tree_tensors(parents: torch.Tensor, max_depth: int, width: int) -> TreeTensors:
    """The :class:`TreeTensors` of B trees given by their parents [B, N+1] int64 (nodes numbered so that a parent
    comes before its children, siblings in rank order; the root, node 0, its own parent), none deeper than
    ``max_depth`` nor wider than ``width`` children. Device ops, no host sync."""
    num, size = parents.shape
    device = parents.device
    nodes = torch.arange(size, device=device)
    depths = torch.zeros_like(parents)
    eye = torch.eye(size, dtype=torch.bool, device=device).expand(num, size, size)
    ancestors = eye
    for _ in range(max_depth):  # each round settles one more level
        depths = torch.where(nodes > 0, depths.gather(1, parents) + 1, 0)
        ancestors = eye | ancestors.gather(1, parents[:, :, None].expand(num, size, size))
    levels = torch.arange(max_depth + 1, device=device)
    at_level = ancestors[:, :, None, :] & (depths[:, None, None, :] == levels[:, None])  # [B, N+1, D+1, N+1]
    paths = torch.where(at_level.any(-1), at_level.to(torch.uint8).argmax(-1), nodes[:, None])
    earlier_sibling = (parents[:, :, None] == parents[:, None, :]) & (nodes[None, None, :] < nodes[:, None]) \
        & (nodes > 0)
    ranks = earlier_sibling.sum(-1)  # [B, N+1]
    children = torch.full((num, size * width + 1), -1, dtype=torch.int64, device=device)
    slot = torch.where(nodes > 0, parents * width + ranks, size * width)  # the root's goes to a scratch column
    children = children.scatter(1, slot, nodes.expand(num, size))[:, :-1].view(num, size, width)
    return TreeTensors(parents, depths, ancestors, paths, children)


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


def compact_path_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, slots: torch.Tensor,
                    base: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """Move the accepted path's K/V rows into place, in one layer's paged cache: path node j of request b (row
    base[b] + path[b, j]) to row base[b] + j, for j < num_accepted[b]. A node's index is never below its depth, so
    no row is read after it was written (done as one gather, then one scatter).

    k_cache, v_cache [num_pages, page_size, Hkv, D]; block_tables [S, P] int32; slots, base, num_accepted [B]
    int64; path [B, D+1] int64."""
    page_size = k_cache.shape[1]
    width = path.shape[1]
    offsets = torch.arange(width, device=path.device)
    keep = offsets[None, :] < num_accepted[:, None]  # [B, D+1]
    src = base[:, None] + path
    dst = base[:, None] + offsets[None, :]
    dst = torch.where(keep, dst, src)  # rows not kept are written back onto themselves
    table = block_tables[slots].long()  # [B, P]

    def flat(rows: torch.Tensor) -> torch.Tensor:
        return table.gather(1, rows // page_size) * page_size + rows % page_size

    src_rows, dst_rows = flat(src).flatten(), flat(dst).flatten()
    for cache in (k_cache, v_cache):
        flat_cache = cache.view(-1, *cache.shape[2:])
        flat_cache.index_copy_(0, dst_rows, flat_cache.index_select(0, src_rows))


def tree_children(tree: DraftTree) -> list[list[int]]:
    """[N+1] lists: each node's children in rank order."""
    children: list[list[int]] = [[] for _ in range(tree.num_nodes + 1)]
    for node in range(1, tree.num_nodes + 1):
        children[tree.parents[node]].append(node)
    ranks = tree.ranks
    return [sorted(c, key=lambda n: ranks[n]) for c in children]


def parent_rows(tree: DraftTree) -> list[int]:
    """[N+1]: the row of each node's draft distribution among the nodes with children (the root's is 0), -1 for
    a leaf: the layout of the per-request draft distributions a sampled tree keeps (only a parent's children are
    drawn from one)."""
    children, rows, next_row = tree_children(tree), [], 0
    for node in range(tree.num_nodes + 1):
        rows.append(next_row if children[node] else -1)
        next_row += bool(children[node])
    return rows


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
