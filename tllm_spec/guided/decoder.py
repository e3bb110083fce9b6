"""GuidedDecoder: grammar masks for the target rows and the draft passes of a speculative step.

TensorRT-LLM's ``CapturableGuidedDecoder`` (``_torch/pyexecutor/guided_decoder.py``) runs the grammar matcher
*inside* the captured graph through CUDA host callbacks: before each draft pass it copies the newest draft to the
host, advances the matcher, fills the bitmask and copies it back. Here nothing inside the step reaches the host:
:meth:`build` fills every mask before the step into stable-address buffers (one host-to-device copy), and
:meth:`execute` / :meth:`execute_draft_batch` apply them with tensor ops only, so the step stays one graph.

What the host knows before the step:

* **Target rows, exact.** A generation request verifies ``[last, d1..dK]``; row j is sampled after ``d1..dj``
  and only used if those drafts are all accepted, so its mask is the grammar state after them: the matcher is
  advanced through the drafts, each row filled, then rolled back. Rows after a draft the grammar refuses can
  never be used (the target's row before it cannot emit that draft) and allow everything.
* **Draft passes, exact where known, else unmasked.** Pass p proposes the token after the bonus token and p
  in-step drafts, none of which the host knows, nor how many drafts will be accepted. The state is known when
  those tokens are forced: where a target row allows a single token the bonus must be it, and where the state
  after it allows a single token, a masked draft must be it too. So for every branch (j drafts accepted, j =
  0..K) the host follows the forced tokens from row j's state and stores, per branch and pass, the mask after
  p + 1 forced tokens, all-ones where the branch is not forced that far (or ends the request: a forced token
  that completes the grammar). Inside the step, :meth:`add_draft_batch` picks each request's branch by its
  accepted count (a device gather, like TensorRT-LLM's ``add_draft_batch(new_tokens, num_accepted_tokens)``).
  A wrong or missing draft mask only costs acceptance (the target rows verify every draft); the target masks
  are what keep the output in the grammar and equal to non-speculative constrained decoding. Forced runs (keys
  and punctuation of a JSON schema) are drafted exactly.
* **A draft tree's rows, exact; its draft passes, where forced.** Node i's row is the grammar state
  after the drafts on its path: the matcher walks the tree depth first (rolled back on the way up); a node whose
  draft the grammar refuses at its parent can never be accepted, and its subtree's rows allow everything. The
  branches are the nodes (the last accepted one picks, inside the step): from node i's state the forced tokens
  give the mask of each depth of the next tree (the whole depth shares it: along a forced run only the most
  likely child can be allowed, and a wrong mask elsewhere only costs acceptance). A dynamic tree's shape lives
  on the device: the engine reads its parents after the step that grew it, before the one that verifies it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import GuidedDecodingParams
from ..drafts.tree import DraftTree, tree_children
from .grammar import BITS, GrammarCompiler, GrammarMatcher, allows, bitmask_width, single_token

ALL = -1  # an int32 word with every bit set: every token allowed


class GuidedDecoder:
    """Per-step grammar masks in stable buffers, int32: ``bitmask`` [max_rows, W] (target rows, flat layout),
    ``draft_bitmask`` [max_batch, K+1, K, W] (per request, branch j = j drafts accepted, draft pass p) and
    ``draft_selected`` [max_batch, K, W] (each request's branch, picked inside the step)."""

    def __init__(self, compiler: GrammarCompiler, max_batch_size: int, max_draft_len: int,
                 device: torch.device | str, tree: DraftTree | None = None, draft_passes: int | None = None):
        """``tree``: a static draft tree, whose N = ``max_draft_len`` drafts a step verifies as a tree (a step
        with fewer verifies a chain a draft-length schedule chose, at most the tree's depth); a dynamic tree's
        shape comes with each step (:meth:`build`). ``draft_passes``: the draft passes a step may mask (a tree's
        depth; default max_draft_len)."""
        self.compiler, self.vocab_size = compiler, compiler.vocab_size
        self.tree_children = tree_children(tree.parents) if tree is not None else None
        passes = tree.max_depth if tree is not None else draft_passes or max_draft_len
        self.max_draft_len = passes  # draft passes masked by forced tokens (a tree's: one per depth)
        width = bitmask_width(self.vocab_size)
        rows, pin = (max_batch_size + 1) * (max_draft_len + 1), torch.device(device).type == "cuda"
        self.bitmask = torch.full((rows, width), ALL, dtype=torch.int32, device=device)
        draft_shape = (max_batch_size + 1, max_draft_len + 1, max(passes, 1), width)  # branch: last accepted row
        self.draft_bitmask = torch.full(draft_shape, ALL, dtype=torch.int32, device=device)
        self.draft_selected = torch.full((draft_shape[0], *draft_shape[2:]), ALL, dtype=torch.int32, device=device)
        self._host = torch.full((rows, width), ALL, dtype=torch.int32, pin_memory=pin)
        self._draft_host = torch.full(draft_shape, ALL, dtype=torch.int32, pin_memory=pin)
        self._shifts = torch.arange(BITS, dtype=torch.int32, device=device)  # [32]

    def matcher(self, params: GuidedDecodingParams) -> GrammarMatcher:
        """A fresh grammar matcher for one request (ValueError if the grammar is invalid)."""
        return self.compiler.matcher(params)

    def build(self, matchers: Sequence[GrammarMatcher | None], drafts: Sequence[Sequence[int]],
              parents: Sequence[Sequence[int] | None] | None = None) -> None:
        """Fill this step's masks on the host and copy them to the device (before the step).

        matchers: per request in batch order (context requests first), None when unguided; drafts: the drafts
        each generation request verifies (empty for context requests); parents: per request, the dynamic tree
        its drafts form (node i + 1's parent at i + 1, the root first), None for a chain (a static tree's
        drafts are known by their number). Context requests own one target row, generation requests K + 1.
        """
        num_rows = sum(1 + len(d) for d in drafts)
        self._host[:num_rows].fill_(ALL)
        self._draft_host[:len(matchers)].fill_(ALL)
        row = 0
        for b, (matcher, request_drafts) in enumerate(zip(matchers, drafts)):
            rows = self._host[row:row + 1 + len(request_drafts)]
            children = self._children_of(request_drafts, parents[b] if parents is not None else None)
            if matcher is not None and children is not None:
                self._fill_tree(matcher, list(request_drafts), rows, self._draft_host[b], children, 0)
            elif matcher is not None:
                self._fill_request(matcher, list(request_drafts), rows, self._draft_host[b])
            row += 1 + len(request_drafts)
        self.bitmask[:num_rows].copy_(self._host[:num_rows], non_blocking=True)
        self.draft_bitmask[:len(matchers)].copy_(self._draft_host[:len(matchers)], non_blocking=True)

    def execute(self, logits: torch.Tensor) -> None:
        """Mask the target rows in place (inside the step). logits [R, V]."""
        allowed = self._unpack(self.bitmask[:logits.shape[0]])
        logits.masked_fill_(~allowed, float("-inf"))

    def add_draft_batch(self, num_accepted: torch.Tensor, last_nodes: torch.Tensor | None = None) -> None:
        """Pick each request's draft-pass masks by its accepted count (inside the step, before drafting).
        num_accepted [B] int64, bonus counted; last_nodes [B]: a tree step's last accepted node (a chain's is
        num_accepted - 1)."""
        batch = torch.arange(num_accepted.shape[0], device=num_accepted.device)
        branch = num_accepted - 1 if last_nodes is None else last_nodes
        self.draft_selected[:num_accepted.shape[0]].copy_(self.draft_bitmask[batch, branch])

    def execute_draft_batch(self, logits: torch.Tensor, d2t: torch.Tensor | None = None, draft_step: int = 0
                            ) -> None:
        """Mask draft pass ``draft_step`` in place (inside the step, after :meth:`add_draft_batch`).
        logits [B, V_draft]; d2t [V_draft] int64 offsets (draft id i is target id i + d2t[i]) or None."""
        allowed = self._unpack(self.draft_selected[:logits.shape[0], draft_step])
        if d2t is not None:
            allowed = allowed[:, torch.arange(d2t.shape[0], device=d2t.device) + d2t]
        allowed |= ~allowed.any(-1, keepdim=True)  # a draft vocabulary without any allowed token: leave unmasked
        logits.masked_fill_(~allowed, float("-inf"))

    def _unpack(self, bitmask: torch.Tensor) -> torch.Tensor:
        """[N, W] int32 -> [N, V] bool."""
        bits = (bitmask.unsqueeze(-1) >> self._shifts) & 1
        return bits.flatten(-2)[:, :self.vocab_size].bool()

    def _fill_request(self, matcher: GrammarMatcher, drafts: list[int], target_rows: torch.Tensor,
                      draft_rows: torch.Tensor) -> None:
        """target_rows [len(drafts)+1, W], draft_rows [K+1, K, W] (host views, all-ones on entry)."""
        consumed = 0
        for j in range(len(drafts) + 1):
            matcher.fill(target_rows, j)
            if matcher.is_stopped():
                break  # complete: the request ends here, nothing after is used
            self._follow_forced(matcher, target_rows[j], draft_rows[j])
            if j == len(drafts) or not allows(target_rows[j], drafts[j]):
                break  # later rows need d_{j+1}, which the target cannot emit here: never used
            matcher.consume(drafts[j])
            consumed += 1
        matcher.rollback(consumed)

    def _children_of(self, drafts: Sequence[int], parents: Sequence[int] | None) -> list[list[int]] | None:
        """Each node's children when ``drafts`` form a tree (a dynamic one's ``parents``, or the static tree's
        N drafts), else None (a chain)."""
        if parents is not None:
            return tree_children(parents)
        if self.tree_children is not None and len(drafts) + 1 == len(self.tree_children):
            return self.tree_children
        return None

    def _fill_tree(self, matcher: GrammarMatcher, drafts: list[int], target_rows: torch.Tensor,
                   draft_rows: torch.Tensor, children: list[list[int]], node: int) -> None:
        """Row ``node`` of a tree's target rows [N+1, W] and its draft branch (draft_rows [N+1, D, W]), then its
        subtree's, the matcher in the state after the node's path (depth first; every consumed draft rolled
        back)."""
        matcher.fill(target_rows, node)
        if matcher.is_stopped():
            return  # complete: the request ends at this node, nothing below it is used
        self._follow_forced(matcher, target_rows[node], draft_rows[node])
        for child in children[node]:
            if allows(target_rows[node], drafts[child - 1]):  # else never accepted: its subtree stays all-ones
                matcher.consume(drafts[child - 1])
                self._fill_tree(matcher, drafts, target_rows, draft_rows, children, child)
                matcher.rollback(1)

    def _follow_forced(self, matcher: GrammarMatcher, row: torch.Tensor, pass_rows: torch.Tensor) -> None:
        """One branch: from the state whose mask is ``row`` [W], follow single-token masks, writing the mask
        after p + 1 forced tokens into pass_rows[p] ([K, W]); passes not forced that far stay all-ones."""
        consumed = 0
        for p in range(self.max_draft_len):
            token = single_token(row)
            if token is None:
                break
            matcher.consume(token)
            consumed += 1
            if matcher.is_stopped():
                break  # the forced token completes the grammar: the request ends, its drafts are never used
            matcher.fill(pass_rows, p)
            row = pass_rows[p]
        matcher.rollback(consumed)
