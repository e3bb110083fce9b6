"""Static draft trees in the one-model step (EAGLE-3, ``eagle_choices``; the CPU reference path): greedy output
equals the target's own greedy decode (the demo pair, batched, with chunked prompts), a tree accepts more per step
than the chain of its depth, seeded sampled requests are reproducible, forced acceptance follows the most likely
children, and what a tree cannot do yet is refused with a clear error."""
from __future__ import annotations

import functools

import pytest
import torch
from pydantic import ValidationError

from tllm_spec import Eagle3Config, SamplingParams, SpecModel

from ..models import tiny_pair

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\nclass ", "    for key, value in ", "class Stack:\n    def __init__(self):\n"]
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0],
        [0, 0, 0, 1], [0, 0, 1, 0]]


@functools.cache
def demo(choices: tuple | None, depth: int, rejection: bool = False, **engine) -> SpecModel:
    spec = None if depth == 0 else Eagle3Config(
        speculative_model="demo://eagle3", max_draft_len=depth, use_rejection_sampling=rejection,
        eagle_choices=[list(c) for c in choices] if choices else None)
    return SpecModel.from_pretrained("demo://target", spec, dtype="float32", device="cpu", max_batch_size=4, **engine)


def tree_model(**engine) -> SpecModel:
    return demo(tuple(tuple(c) for c in TREE), 4, **engine)


@pytest.mark.slow  # five seconds on the 2-core machine, out of the README command for its margin
def test_greedy_tree_output_is_the_targets_own_and_accepts_more_than_a_chain():
    params = SamplingParams(max_new_tokens=48)
    plain = demo(None, 0).generate(PROMPTS, params)
    tree = tree_model(max_num_batched_tokens=6).generate(PROMPTS, params)  # prompts prefilled in chunks of 6
    chain = demo(None, 4).generate(PROMPTS, params)
    assert [o.token_ids for o in tree] == [o.token_ids for o in plain]
    assert [o.token_ids for o in chain] == [o.token_ids for o in plain]
    assert tree.stats["mean_accepted_length"] > chain.stats["mean_accepted_length"] * 1.1
    assert max(max(o.stats.accepted_per_step) for o in tree) == 5  # whole paths to depth 4 were accepted


@pytest.mark.slow  # three to four seconds on the 2-core machine, out of the README command for its margin
def test_seeded_sampled_tree_requests_are_reproducible():
    params = [SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=11 + i) for i in range(4)]
    model = tree_model()
    first, second = model.generate(PROMPTS, params), model.generate(PROMPTS[::-1], params[::-1])
    assert [o.token_ids for o in first] == [o.token_ids for o in second][::-1]  # batch order does not matter
    assert len({tuple(o.token_ids) for o in first}) == 4


def forced_accepted_per_step(model: SpecModel, forced: int, monkeypatch) -> set[int]:
    """Tokens each step accepted (bonus included) over two requests decoded with ``forced`` drafts forced."""
    monkeypatch.setenv("TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS", str(forced))
    model.runner.refresh_forced_acceptance()
    try:
        outs = model.generate(PROMPTS[:2], SamplingParams(max_new_tokens=31, ignore_eos=True))
    finally:
        monkeypatch.delenv("TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS")
        model.runner.refresh_forced_acceptance()
    return {n for o in outs for n in o.stats.accepted_per_step[:-1]}  # the last step is cut by max tokens


def test_forced_acceptance_follows_the_most_likely_children(monkeypatch):
    assert forced_accepted_per_step(tree_model(), 2, monkeypatch) == {3}


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_a_draft_len_schedule_switches_between_the_tree_and_chains(tree):
    """{1: N, 2: 2, 4: 0}: four requests of different lengths start as a batch of 4 (no drafts), go on as 3 and 2
    (chains of 2) and end alone (the tree); a request decoding alone (the tree) joined by another goes on with
    chains, then the tree again: steps move between tree, chain and none both ways, and the greedy output stays
    the target's own."""
    target, head = tiny_pair("llama", head_scale=4.0)
    shape = (dict(eagle_choices=TREE) if tree == "static" else
             dict(use_dynamic_tree=True, dynamic_tree_max_topK=3, max_total_draft_tokens=14))
    cfg = Eagle3Config(speculative_model=str(head), max_draft_len=4, draft_len_schedule={1: 14, 2: 2, 4: 0},
                       **shape)
    model = SpecModel.from_pretrained(target, cfg, max_batch_size=4)
    prompts = [[1 + (5 * i + j) % 90 for j in range(4 + 2 * i)] for i in range(4)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 12, 20, 40)]
    plain = SpecModel.from_pretrained(target, None, max_batch_size=4).generate(prompts, params)
    outs = model.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert outs[3].stats.drafts_per_step[0] == 2 and outs[3].stats.drafts_per_step[-1] == 14  # steps of 0: not kept
    stream = iter(model.generate_stream(prompts[3], params[3]))  # alone: the tree; then joined by another
    first = next(stream)
    joined = model.generate(prompts[:1], params[0])[0]
    rest = list(stream)
    assert first.token_ids + [t for out in rest for t in out.token_ids] == plain[3].token_ids
    assert joined.token_ids == plain[0].token_ids and set(joined.stats.drafts_per_step) <= {2}  # joined as a chain
    drafts = rest[-1].output.stats.drafts_per_step
    assert drafts[0] == 14 and 2 in drafts and drafts[-1] == 14  # tree, chain while two ran, tree again


@pytest.mark.parametrize("schedule, message", [({1: 14, 2: 5}, "0..4"), ({1: 13}, "14 \\(the tree\\)")])
def test_a_tree_schedule_with_lengths_neither_the_tree_nor_a_chain_is_refused(schedule, message):
    with pytest.raises(ValidationError, match=message):
        Eagle3Config(speculative_model="x", max_draft_len=4, eagle_choices=TREE, draft_len_schedule=schedule)


@pytest.mark.slow  # ten seconds or more on the 2-core CI machine: the second CI command runs it
def test_sampled_trees_with_rejection_sampling():
    """Rejection sampling on a tree: greedy requests in the batch keep the target's greedy output, seeded sampled
    requests are reproducible whatever the batch order, and sampled requests accept more per step than strict
    verification of the same tree (the emitted tokens' distribution: tests/sampling/test_rejection.py)."""
    rejection = demo(tuple(tuple(c) for c in TREE), 4, rejection=True)
    greedy = SamplingParams(max_new_tokens=40)
    sampled = [SamplingParams(max_new_tokens=40, temperature=1.0, seed=21 + i) for i in range(3)]
    outs = rejection.generate(PROMPTS, [greedy, *sampled])
    assert outs[0].token_ids == demo(None, 0).generate(PROMPTS[:1], greedy)[0].token_ids
    again = rejection.generate(PROMPTS[::-1], [*sampled[::-1], greedy])
    assert [o.token_ids for o in outs] == [o.token_ids for o in again][::-1]
    many = [SamplingParams(max_new_tokens=48, temperature=1.0, seed=s) for s in range(8)]
    prompts = PROMPTS * 2
    strict = tree_model().generate(prompts, many).stats["mean_accepted_length"]
    assert rejection.generate(prompts, many).stats["mean_accepted_length"] > strict * 1.1


def test_a_tree_too_big_for_the_mask_is_refused_at_load():
    target, head = tiny_pair("llama")
    with pytest.raises((ValueError, ValidationError), match="does not fit"):
        SpecModel.from_pretrained(target, Eagle3Config(speculative_model=str(head), max_draft_len=1,
                                                       eagle_choices=[[i] for i in range(63)]))


def test_a_sampled_tree_with_a_rank_gap_draws_consecutive_children():
    """eagle_choices [[0], [2]]: a sampled request's two children are its first two draws without replacement
    (the rank only orders a greedy request's children), so recursive rejection sampling emits the target's
    distribution; keeping draws 1 and 3 instead biases it (third token 0.42 where the target has 0.30)."""
    from scipy.stats import chi2

    from tllm_spec.drafts.eagle3.tree_step import TreeStep
    from tllm_spec.drafts.metadata import SpecMetadata
    from tllm_spec.drafts.tree import DraftTree
    from tllm_spec.drafts.tree_verify import tree_rejection_sample

    trials, p, q = 30000, torch.tensor([0.05, 0.15, 0.3, 0.5]), torch.tensor([0.6, 0.25, 0.1, 0.05])
    step = TreeStep(DraftTree.from_choices([[0], [2]]))

    class Head:  # the draft's distribution is q at the root, whatever the hidden state
        vocab_offsets = None

        def compute_logits(self, hidden):
            return q.log().expand(hidden.shape[0], -1).clone()

    metadata = SpecMetadata(trials, step.num_nodes, 4, "cpu")
    metadata.prepare([SamplingParams(temperature=1.0)] * trials, (1,) * trials, step.num_nodes, step.num_nodes)
    draft_probs = torch.zeros(trials, step.num_parents, 4)
    slots = torch.arange(trials)
    drafts = step.draft(Head(), torch.zeros(trials, 1), torch.zeros(trials, dtype=torch.int64), slots, None,
                        metadata, draft_probs)
    assert (drafts[:, 0] != drafts[:, 1]).all()  # without replacement
    num, tokens, _ = tree_rejection_sample(step.tensors, p.expand(trials, 3, 4), draft_probs, drafts,
                                           torch.arange(trials), torch.zeros(trials, dtype=torch.int64),
                                           step.prob_rows)
    counts = torch.bincount(tokens[:, 0], minlength=4).double()
    expected = p.double() / p.double().sum() * counts.sum()
    assert chi2.sf(float(((counts - expected) ** 2 / expected).sum()), 3) > 1e-3
    assert (num == 1).any() and (num == 2).any()
