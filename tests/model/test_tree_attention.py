"""Tree attention through the real target (reference path): after a prompt, one forward over a draft tree's root
and nodes (each node at cache row base + index, rotated by base + depth, seeing only its path) gives every node
the logits the target's own HF forward gives the prompt followed by that node's path; and after the accepted
path's K/V is moved into place, a plain next step decodes as if the path had been decoded one token at a time."""
from __future__ import annotations

import pytest
import torch

from tllm_spec.drafts.tree import DraftTree
from tllm_spec.drafts.tree_verify import compact_path_kv
from tllm_spec.model.attention import AttentionMetadata
from tllm_spec.spec_model import SpecModel

from ..models import hf_model, tiny_pair

CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]
PROMPT = [5, 17, 33, 2, 71, 8, 40, 3, 19, 60, 11]  # 11 tokens: the tree crosses a 16-token page


def forward(model: SpecModel, slot: int, ids: list[int], rows: list[int], rope=None, mask=None) -> torch.Tensor:
    """The target over ``ids`` at cache ``rows`` of ``slot`` -> logits [len(ids), V]."""
    runner = model.runner
    n = len(ids)
    context = rope is None and rows[0] == 0
    attn = AttentionMetadata.build(runner.kv_cache, torch.full((n,), slot), torch.tensor(rows), max(rows) + 1,
                                   context_lens=(n,) if context else (), tokens_per_request=1 if context else n)
    if rope is not None:
        attn = AttentionMetadata(**{**vars(attn), "rope_positions": torch.tensor(rope), "tree_mask": mask})
    with torch.inference_mode():
        hidden, _ = runner.target(torch.tensor(ids), attn)
        return runner.target.compute_logits(hidden)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "stock"])
def test_a_tree_forward_equals_each_paths_own_forward(fused):
    target, _ = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, None, dtype="float32", device="cpu", max_batch_size=1,
                                      use_fused_layers=fused)
    tree = DraftTree.from_choices(CHOICES)
    tensors = tree.tensors()
    slot = model.runner.kv_cache.allocate(64)
    forward(model, slot, PROMPT, list(range(len(PROMPT))))
    gen = torch.Generator().manual_seed(0)
    tokens = [29] + torch.randint(0, 97, (tree.num_nodes,), generator=gen).tolist()  # root, then the drafts
    base = len(PROMPT)
    logits = forward(model, slot, tokens, [base + i for i in range(tree.num_nodes + 1)],
                     rope=[base + d for d in tree.depths], mask=tensors.relative_masks())
    hf = hf_model(target)
    for node, path in enumerate(tree.paths()):
        sequence = PROMPT + [tokens[i] for i in path]
        with torch.no_grad():
            expected = hf(torch.tensor([sequence])).logits[0, -1]
        torch.testing.assert_close(logits[node], expected, atol=2e-4, rtol=2e-4)

    # accept the path to node 7 ((0, 1, 0)): move its K/V into place, then decode on from it as a chain
    path = tensors.paths[7]
    num = int(tensors.depths[7]) + 1
    kv = model.runner.kv_cache
    for k_cache, v_cache in zip(kv.k, kv.v):
        compact_path_kv(k_cache, v_cache, kv.block_tables, torch.tensor([slot]), torch.tensor([base]), path[None],
                        torch.tensor([num]))
    accepted = [tokens[i] for i in path[:num].tolist()]
    step = forward(model, slot, [13, 44], [base + num, base + num + 1])
    sequence = PROMPT + accepted + [13, 44]
    with torch.no_grad():
        expected = hf(torch.tensor([sequence])).logits[0, -2:]
    torch.testing.assert_close(step, expected, atol=2e-4, rtol=2e-4)


def test_a_chains_mask_is_causal_attention():
    """A chain's relative masks change nothing: the same logits as the plain causal forward."""
    target, _ = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, None, dtype="float32", device="cpu", max_batch_size=1)
    slot = model.runner.kv_cache.allocate(64)
    forward(model, slot, PROMPT, list(range(len(PROMPT))))
    base, ids = len(PROMPT), [29, 4, 50, 7]
    rows = [base + i for i in range(4)]
    masked = forward(model, slot, ids, rows, rope=rows, mask=DraftTree.chain(3).tensors().relative_masks())
    plain = forward(model, slot, ids, rows)
    torch.testing.assert_close(masked, plain, atol=0, rtol=0)


def test_a_tree_too_big_for_the_mask_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        DraftTree.from_choices([[i] for i in range(63)]).tensors().relative_masks()


def test_the_eagle3_heads_tree_pass_equals_each_paths_own_pass():
    """The draft head over a tree (its first pass over a verify step's tokens takes the same metadata): every
    node's output equals the head's chain pass over the node's path."""
    from tllm_spec import Eagle3Config

    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, Eagle3Config(speculative_model=str(head), max_draft_len=4),
                                      dtype="float32", device="cpu", max_batch_size=2)
    draft, kv = model.worker.draft_model, model.runner.kv_cache
    tree = DraftTree.from_choices(CHOICES)
    tensors = tree.tensors()
    gen = torch.Generator().manual_seed(1)
    width = draft.fc.in_features
    prompt_features = torch.randn(len(PROMPT), width, generator=gen)
    nodes = tree.num_nodes + 1
    tokens = torch.randint(0, 97, (nodes,), generator=gen)
    features = torch.randn(nodes, width, generator=gen)
    base = len(PROMPT)

    def run(slot, ids, feats, rows, rope=None, mask=None, context=False):
        n = len(rows)
        attn = AttentionMetadata.build(kv, torch.full((n,), slot), torch.tensor(rows), max(rows) + 1,
                                       context_lens=(n,) if context else (), tokens_per_request=1 if context else n)
        if rope is not None:
            attn = AttentionMetadata(**{**vars(attn), "rope_positions": torch.tensor(rope), "tree_mask": mask})
        with torch.inference_mode():
            return draft(ids, feats, attn)

    tree_slot, chain_slot = kv.allocate(64), kv.allocate(64)
    for slot in (tree_slot, chain_slot):  # the prompt's draft K/V, the same in both
        run(slot, torch.tensor(PROMPT[1:] + [int(tokens[0])]), prompt_features, list(range(base)), context=True)
    out = run(tree_slot, tokens, features, [base + i for i in range(nodes)], rope=[base + d for d in tree.depths],
              mask=tensors.relative_masks())
    for node, path in enumerate(tree.paths()):
        chain = run(chain_slot, tokens[path], features[path], [base + j for j in range(len(path))])
        torch.testing.assert_close(out[node], chain[-1], atol=1e-5, rtol=1e-5)
