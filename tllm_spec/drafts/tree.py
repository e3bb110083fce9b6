"""Draft trees: the structure of an EAGLE tree, on the host and as device tensors. A static tree (:class:`DraftTree`)
is one for every request; a dynamic one (``eagle3/dynamic_tree.py``) is one per request, given by its parents
(:func:`tree_tensors`); verification (:mod:`.tree_verify`) takes either.

A tree is given as TensorRT-LLM's ``eagle_choices``: one path per node, the top-k rank taken at each depth from
the root, e.g. ``[[0], [1], [0, 0], [0, 1], [1, 0]]`` (the root is the last accepted token; ``[0, 1]`` is the
second most likely child of the most likely first draft). Nodes are numbered breadth-first with the root as node
0, so a node's index is never below its depth and a parent's index is below its children's.

"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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
        return tree_tensors(parents[None], self.max_depth, max(map(len, tree_children(self.parents))))[0]


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
        return self._map(lambda x: x[index])

    def batched(self, num: int) -> TreeTensors:
        """One tree per request: a shared tree expanded (views) to ``num`` requests; a batched one as it is."""
        if self.parents.dim() == 2:
            return self
        return self._map(lambda x: x.expand(num, *x.shape))

    def _map(self, fn) -> TreeTensors:
        # fields named, not vars(self): torch 2.11's Dynamo breaks the compiled step's graph at vars() of an object
        return TreeTensors(fn(self.parents), fn(self.depths), fn(self.ancestors), fn(self.paths), fn(self.children))

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


def tree_children(parents: Sequence[int]) -> list[list[int]]:
    """[N+1] lists: each node's children in rank order (node order: a static tree numbers siblings by rank, a
    dynamic one by creation), from the nodes' parents (the root, node 0, its own)."""
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents[1:], start=1):
        children[parent].append(node)
    return children


def parent_rows(tree: DraftTree) -> list[int]:
    """[N+1]: the row of each node's draft distribution among the nodes with children (the root's is 0), -1 for
    a leaf: the layout of the per-request draft distributions a sampled tree keeps (only a parent's children are
    drawn from one)."""
    children, rows, next_row = tree_children(tree.parents), [], 0
    for node in range(tree.num_nodes + 1):
        rows.append(next_row if children[node] else -1)
        next_row += bool(children[node])
    return rows


def first_child_chains(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Each tree's chain of first children from the root (a node's first child: its lowest-numbered one, the
    most likely). parents [B, N+1] int64 (node 0 the root) -> [B, max_depth] int64 node indices, 0 past the
    chain's end (the root is never on it)."""
    num, size = parents.shape
    nodes = torch.arange(size, device=parents.device)
    is_child = parents[:, None, 1:] == nodes[None, :, None]  # [B, N+1, N]: node j + 1 is a child of node i
    first = torch.where(is_child, nodes[1:], size).amin(dim=2)  # [B, N+1], size: no child
    first = torch.cat([first, first.new_full((num, 1), size)], dim=1)  # the end maps to itself
    chain, node = [], parents.new_zeros(num, 1)
    for _ in range(max_depth):
        node = first.gather(1, node)
        chain.append(node)
    chain = torch.cat(chain, dim=1)
    return torch.where(chain == size, 0, chain)
