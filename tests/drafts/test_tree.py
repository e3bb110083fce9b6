"""Draft trees (drafts/tree.py): eagle_choices validation and order, greedy tree verification (equal to strict
acceptance on a chain, to a brute-force search on any tree, and lossless in a decode loop against a target's own
greedy tokens), forced paths, and moving the accepted path's K/V into place in a paged cache."""
from __future__ import annotations

import random

import pytest
import torch

from tllm_spec.drafts.base import strict_acceptance
from tllm_spec.drafts.tree import DraftTree
from tllm_spec.drafts.tree_verify import compact_path_kv, forced_tree_path, path_rows, tree_greedy_accept
from tllm_spec.kernels.move_rows import cache_table

TREES = {
    "chain3": [[0], [0, 0], [0, 0, 0]],
    "binary2": [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1]],
    "eagle_like": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]],
}


@pytest.mark.parametrize("choices, message", [
    ([], "at least one"), ([[0], []], "empty path"), ([[0], [0]], "twice"), ([[0], [-1]], "negative"),
    ([[0], [1, 0]], "prefix-closed"), ([[0, 0]], "prefix-closed")])
def test_bad_choices_are_refused(choices, message):
    with pytest.raises(ValueError, match=message):
        DraftTree.from_choices(choices)


def test_nodes_are_breadth_first_with_parents_before_children():
    tree = DraftTree.from_choices([[1, 0], [0, 1], [1], [0], [0, 0]])
    assert tree.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert tree.parents == [0, 0, 0, 1, 1, 2] and tree.depths == [0, 1, 1, 2, 2, 2] and tree.ranks == [0, 0, 1, 0, 1, 0]
    assert (tree.num_nodes, tree.max_depth, tree.is_chain) == (5, 2, False)
    assert tree.paths()[5] == [0, 2, 5]
    assert DraftTree.chain(3).choices == ((0,), (0, 0), (0, 0, 0)) and DraftTree.chain(3).is_chain
    mask = DraftTree.chain(3).tensors().ancestors
    assert torch.equal(mask, torch.ones(4, 4, dtype=torch.bool).tril())  # a chain: causal


def brute_force(tree: DraftTree, drafts: list[int], targets: list[int]) -> tuple[int, list[int]]:
    """The deepest node whose every path draft equals the target token at its parent (first in node order)."""
    best, best_depth = 0, 0
    parents, depths = tree.parents, tree.depths
    for node, path in enumerate(tree.paths()):
        if all(drafts[j - 1] == targets[parents[j]] for j in path[1:]) and depths[node] > best_depth:
            best, best_depth = node, depths[node]
    return best_depth + 1, tree.paths()[best]


@pytest.mark.parametrize("name", sorted(TREES))
def test_greedy_accept_equals_a_brute_force_search(name):
    tree = DraftTree.from_choices(TREES[name])
    tensors = tree.tensors()
    gen = torch.Generator().manual_seed(0)
    for vocab in (2, 3, 50):  # small vocabularies: many matches
        drafts = torch.randint(0, vocab, (64, tree.num_nodes), generator=gen)
        targets = torch.randint(0, vocab, (64, tree.num_nodes + 1), generator=gen)
        num, path, tokens = tree_greedy_accept(tensors, drafts, targets)
        for b in range(64):
            n, expected_path = brute_force(tree, drafts[b].tolist(), targets[b].tolist())
            assert num[b] == n and path[b, :n].tolist() == expected_path
            assert tokens[b, :n].tolist() == [targets[b, i].item() for i in expected_path]


def test_a_chain_tree_is_strict_acceptance():
    tensors = DraftTree.chain(4).tensors()
    gen = torch.Generator().manual_seed(1)
    drafts = torch.randint(0, 3, (200, 4), generator=gen)
    targets = torch.randint(0, 3, (200, 5), generator=gen)
    num, path, tokens = tree_greedy_accept(tensors, drafts, targets)
    strict_num, strict_tokens = strict_acceptance(targets.flatten(), drafts)
    assert torch.equal(num, strict_num)
    valid = torch.arange(5)[None, :] < num[:, None]  # the emitted tokens (past them both hold scratch)
    assert torch.equal(tokens[valid], strict_tokens[valid])
    assert torch.equal(path, torch.arange(5).expand(200, 5).minimum((num - 1)[:, None]))


def test_tree_decoding_emits_the_targets_own_greedy_tokens():
    """A decode loop with a tree: the target's greedy next token is a fixed function of the last two tokens, the
    draft's ranked guesses are right often but not always; every step's emitted tokens continue the target's own
    greedy sequence, and the tree accepts more per step than the chain of its depth."""
    vocab = 7

    def target_next(a: int, b: int) -> int:
        return (3 * a + 5 * b + 1) % vocab

    def draft_ranked(a: int, b: int, rng: random.Random) -> list[int]:
        right = target_next(a, b)
        wrong = [t for t in range(vocab) if t != right]
        rng.shuffle(wrong)
        return [right] + wrong if rng.random() < 0.6 else wrong[:1] + [right] + wrong[1:]

    def decode(tree: DraftTree, steps: int) -> tuple[list[int], float]:
        tensors, rng = tree.tensors(), random.Random(0)
        seq, per_step = [1, 2], []
        for _ in range(steps):
            context = {0: seq[-2:]}  # node -> its last two tokens (the root: the sequence's)
            drafts = []
            for node in range(1, tree.num_nodes + 1):
                parent, rank = tree.parents[node], tree.ranks[node]
                a, b = context[parent]
                token = draft_ranked(a, b, random.Random(hash((a, b, len(seq), rng.random()))))[rank]
                drafts.append(token)
                context[node] = [b, token]
            targets = [target_next(*context[node]) for node in range(tree.num_nodes + 1)]
            num, _, tokens = tree_greedy_accept(tensors, torch.tensor([drafts]), torch.tensor([targets]))
            seq += tokens[0, :num[0]].tolist()
            per_step.append(int(num[0]))
        return seq, sum(per_step) / len(per_step)

    tree_seq, tree_rate = decode(DraftTree.from_choices(TREES["eagle_like"]), 60)
    chain_seq, chain_rate = decode(DraftTree.chain(4), 60)
    expected = [1, 2]
    while len(expected) < max(len(tree_seq), len(chain_seq)):
        expected.append(target_next(*expected[-2:]))
    assert tree_seq == expected[:len(tree_seq)] and chain_seq == expected[:len(chain_seq)]
    assert tree_rate > chain_rate


def test_forced_paths_follow_the_most_likely_children():
    tree = DraftTree.from_choices(TREES["eagle_like"])
    tensors = tree.tensors()
    path = forced_tree_path(tensors, torch.tensor([1, 2, 3, 5, 9]))
    spine = [0, 1, 4, 7, 10]  # (0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)
    assert [tree.choices[i - 1] for i in spine[1:]] == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
    assert path.tolist() == [[0] * 5, [0, 1, 1, 1, 1], [0, 1, 4, 4, 4], spine, spine]


def test_compacting_moves_the_accepted_path_into_place():
    page_size, heads, dim, pages = 4, 2, 3, 12
    gen = torch.Generator().manual_seed(2)
    k_cache = torch.randn(pages, page_size, heads, dim, generator=gen)
    v_cache = torch.randn(pages, page_size, heads, dim, generator=gen)
    block_tables = torch.randperm(pages, generator=gen).to(torch.int32).view(2, 6)  # two requests' pages
    slots, base = torch.tensor([1, 0]), torch.tensor([5, 2])
    path = torch.tensor([[0, 2, 5, 9], [0, 1, 1, 1]])  # request 0 keeps 4 nodes, request 1 two
    num_accepted = torch.tensor([4, 2])
    k_before, v_before = k_cache.clone(), v_cache.clone()
    op_k, op_v = k_cache.clone(), v_cache.clone()
    compact_path_kv(k_cache, v_cache, block_tables, slots, base, path, num_accepted)
    src, dst = path_rows(block_tables, slots, base, path, num_accepted, page_size)
    torch.ops.tllm_spec.move_cache_rows([op_k, op_v], cache_table([op_k, op_v]), src, dst, path.shape[1])
    assert torch.equal(op_k, k_cache) and torch.equal(op_v, v_cache)  # the op the compiled step calls

    def row(cache, slot, position):
        table = block_tables[slot].long()
        return cache[table[position // page_size], position % page_size]
    for b in range(2):
        moved = {int(base[b]) + j: int(base[b] + path[b, j]) for j in range(int(num_accepted[b]))}
        for position in range(24):
            source = moved.get(position, position)
            assert torch.equal(row(k_cache, slots[b], position), row(k_before, slots[b], source))
            assert torch.equal(row(v_cache, slots[b], position), row(v_before, slots[b], source))


def sample_tree(tree: DraftTree, draft: torch.Tensor, root_token: int, trials: int, gen: torch.Generator
                ) -> torch.Tensor:
    """Draft tokens [trials, N]: each node's children drawn one after the other without replacement from the
    draft's distribution after the node's token (Gumbel top-k), as tree_rejection_sample requires."""
    children = [[] for _ in range(tree.num_nodes + 1)]
    for node in range(1, tree.num_nodes + 1):
        children[tree.parents[node]].append(node)
    token = torch.full((trials, tree.num_nodes + 1), root_token)
    for node in range(tree.num_nodes + 1):  # breadth-first: a parent's token is known before its children
        kids = sorted(children[node], key=lambda n: tree.ranks[n])
        if not kids:
            continue
        q = draft[token[:, node]]  # [trials, V]
        gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=gen).clamp(min=1e-12)))
        order = (q.log() + gumbel).argsort(dim=1, descending=True)
        for kid in kids:
            token[:, kid] = order[:, tree.ranks[kid]]
    return token


@pytest.mark.parametrize("name,support", [("binary2", 4), ("eagle_like", 4), ("chain3", 4), ("eagle_like", 2)])
def test_sampled_tree_verification_keeps_the_targets_distribution(name, support):
    """Markov target and draft over 4 tokens: the first three tokens a step emits (completed by sampling the
    target, as the next steps would) follow the target's own joint distribution, cell by cell within 5 sigma."""
    from tllm_spec.drafts.tree_verify import tree_rejection_sample
    vocab, trials = 4, 40000
    gen = torch.Generator().manual_seed(3)
    target = torch.softmax(2 * torch.randn(vocab, vocab, generator=gen), dim=1)  # P(next | last)
    draft = torch.softmax(2 * torch.randn(vocab, vocab, generator=gen), dim=1)
    if support < vocab:  # a draft top-k: nodes with more children than q has tokens draw some from outside it
        kept = draft.topk(support, dim=1).indices
        draft = torch.zeros_like(draft).scatter(1, kept, draft.gather(1, kept))
        draft /= draft.sum(1, keepdim=True)
    tree = DraftTree.from_choices(TREES[name])
    tokens = sample_tree(tree, draft, 0, trials, gen)
    streams = torch.full((trials,), 3), torch.arange(trials)  # one stream per trial
    num, out, path = tree_rejection_sample(tree, target[tokens], draft[tokens], tokens[:, 1:], *streams)
    assert (num >= 1).all() and (num <= tree.max_depth + 1).all()
    parents, depths = torch.tensor(tree.parents), torch.tensor(tree.depths)
    for j in range(1, tree.max_depth + 1):  # the path: accepted children from the root, their tokens emitted
        on = j < num
        assert (parents[path[on, j]] == path[on, j - 1]).all() and (depths[path[on, j]] == j).all()
        assert torch.equal(tokens.gather(1, path)[on, j], out[on, j - 1])
        assert torch.equal(path[~on, j], path[~on, j - 1])  # padded with the last node
    seq = torch.zeros(trials, 3, dtype=torch.int64)
    last = torch.zeros(trials, dtype=torch.int64)
    for j in range(3):
        drawn = torch.multinomial(target[last], 1, generator=gen)[:, 0]
        seq[:, j] = torch.where(j < num, out[:, min(j, out.shape[1] - 1)], drawn)
        last = seq[:, j]
    counts = torch.bincount(seq[:, 0] * vocab * vocab + seq[:, 1] * vocab + seq[:, 2], minlength=vocab ** 3)
    empirical = counts.double() / trials
    exact = (target[0][:, None, None] * target[:, :, None] * target[None]).double().flatten()
    sigma = (exact * (1 - exact) / trials).sqrt()
    assert ((empirical - exact).abs() <= 5 * sigma + 1e-4).all()
    if name != "chain3":
        assert num.double().mean() > 1.2  # drafts are accepted: the test exercises acceptance, not just fallback


def test_a_rejection_that_leaves_no_residual_keeps_the_target_row():
    """p below q at the drawn token and nowhere above it (p equals q to float rounding, exaggerated here so that
    rejections are frequent): the residual has no mass, and the emitted token is still drawn from p, never the
    index 0 of an all-zero row."""
    from tllm_spec.drafts.tree_verify import tree_rejection_sample
    tree = DraftTree.from_choices([[0]])
    q = torch.tensor([0.0, 0.5, 0.5])
    p = torch.tensor([0.0, 0.25, 0.25])  # below q wherever q has mass
    trials = 4000
    target, draft = p.expand(trials, 2, 3), q.expand(trials, 2, 3)
    drafts = torch.ones(trials, 1, dtype=torch.int64)
    num, out, _ = tree_rejection_sample(tree, target, draft, drafts, torch.full((trials,), 5), torch.arange(trials))
    assert (num == 1).any()  # some draws rejected the child
    assert (out[num == 1, 0] != 0).all()  # p gives token 0 no mass
