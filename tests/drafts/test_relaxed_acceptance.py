"""Relaxed acceptance golden cases on an 8-token vocabulary (token 6 = <think>, token 7 = </think>).

Rows are given as probabilities (the rest of the mass spread evenly); the target token of a row is its
argmax, as for greedy requests. Draft j is checked against row j; row K is the bonus row.
"""
import math

import pytest
import torch

from tllm_spec.drafts.mtp.relaxed import (
    RelaxedAcceptance,
    prompt_thinking_state,
    relaxed_acceptance,
    thinking_state_after,
)

V, BEGIN, END = 8, 6, 7


def row(probs: dict[int, float]) -> list[float]:
    """Logits with the given probabilities; the remaining mass is shared by the other tokens."""
    rest = (1.0 - sum(probs.values())) / (V - len(probs))
    return [math.log(probs.get(t, rest)) for t in range(V)]


def run(rows, drafts, thinking, topk=3, delta=0.2):
    """rows: [G][K+1] probability dicts; drafts [G][K]; thinking [G] -> (num_accepted, tokens) as lists."""
    logits = torch.tensor([[row(r) for r in req] for req in rows])
    n, tokens = relaxed_acceptance(logits, logits.argmax(-1), torch.tensor(drafts), torch.tensor(thinking),
                                   topk, delta, BEGIN, END)
    return n.tolist(), tokens.tolist()


def test_outside_thinking_is_strict():
    rows = [[{1: 0.5, 2: 0.45},   # draft 2: second best and within delta, but not thinking -> rejected
             {3: 0.9},            # (not reached)
             {4: 0.9}]]           # bonus row
    n, tokens = run(rows, [[2, 3]], [False])
    assert n == [1] and tokens[0][0] == 1  # the target's own token corrects


def test_inside_thinking_accepts_close_candidates():
    rows = [[{1: 0.5, 2: 0.35},   # draft 2: p = 0.35 >= 0.5 - 0.2 -> accepted (relaxed)
             {3: 0.6, 4: 0.3},    # draft 4: p = 0.30 < 0.6 - 0.2 = 0.40 -> rejected
             {5: 0.9}]]
    n, tokens = run(rows, [[2, 4]], [True])
    assert n == [2] and tokens[0][:2] == [2, 3]  # the accepted row holds the DRAFT token, then the correction


@pytest.mark.parametrize("p2,accepted", [(0.31, True), (0.29, False)])
def test_delta_boundary(p2, accepted):
    rows = [[{1: 0.5, 2: p2},     # threshold 0.5 - 0.2 = 0.30
             {3: 0.9}]]
    n, tokens = run(rows, [[2]], [True], topk=2, delta=0.2)
    assert n == ([2] if accepted else [1])
    assert tokens[0] == ([2, 3] if accepted else [1, 3])


@pytest.mark.parametrize("topk,accepted", [(2, False), (3, True)])
def test_topk_boundary(topk, accepted):
    rows = [[{1: 0.36, 2: 0.33, 5: 0.3},  # draft 5 is the 3rd candidate, within delta of the top-1
             {3: 0.9}]]
    n, _ = run(rows, [[5]], [True], topk=topk, delta=0.2)
    assert n == ([2] if accepted else [1])


def test_top1_accepted_with_zero_delta_while_thinking():
    rows = [[{1: 0.4, 2: 0.39},   # draft 1 = top-1 -> accepted; delta 0 admits nothing else
             {2: 0.4, 3: 0.39},   # draft 3: second best, delta 0 -> rejected
             {4: 0.9}]]
    n, tokens = run(rows, [[1, 3]], [True], topk=8, delta=0.0)
    assert n == [2] and tokens[0][:2] == [1, 2]


def test_end_marker_inside_window_switches_to_strict():
    rows = [[{1: 0.5, 2: 0.4},    # draft 2: relaxed accept (thinking)
             {END: 0.9},          # draft </think> = top-1: accepted, thinking ends here
             {3: 0.5, 4: 0.45},   # draft 4: would be relaxed-ok, but judged strictly now -> rejected
             {5: 0.9}]]
    n, tokens = run(rows, [[2, END, 4]], [True])
    assert n == [3] and tokens[0][:3] == [2, END, 3]
    assert thinking_state_after(torch.tensor(tokens), torch.tensor(n), torch.tensor([True]), BEGIN, END).tolist() \
        == [False]


def test_begin_marker_inside_window_switches_to_relaxed():
    rows = [[{BEGIN: 0.9},        # draft <think> = top-1: accepted strictly, thinking starts
             {3: 0.5, 4: 0.45},   # draft 4: second best within delta -> accepted (relaxed now)
             {5: 0.5, 2: 0.1},    # draft 2: p = 0.1 < 0.5 - 0.2 -> rejected
             {1: 0.9}]]
    n, tokens = run(rows, [[BEGIN, 4, 2]], [False])
    assert n == [3] and tokens[0][:3] == [BEGIN, 4, 5]


def test_batch_mixed_thinking_states():
    same = [{1: 0.5, 2: 0.4},     # draft 2: accepted only by the thinking request
            {3: 0.9}]
    n, tokens = run([same, same], [[2], [2]], [True, False])
    assert n == [2, 1] and tokens[0] == [2, 3] and tokens[1][0] == 1


def test_state_after_accepted_tokens_only():
    tokens = torch.tensor([[3, BEGIN, 4, 5],   # n = 3: <think> accepted -> thinking
                           [3, 4, BEGIN, 5],   # n = 2: the <think> lies past the accepted tokens -> unchanged
                           [END, 2, BEGIN, 1],  # n = 4: the last marker wins -> thinking
                           [2, END, 1, 1]])    # n = 2: the correction token closes -> not thinking
    state = thinking_state_after(tokens, torch.tensor([3, 2, 4, 2]), torch.tensor([False, False, False, True]),
                                 BEGIN, END)
    assert state.tolist() == [True, False, True, False]


def test_prompt_state_is_per_request():
    prompts = [[1, BEGIN, 2, 3],      # opened -> thinking
               [4, 5],                # no marker: must not inherit the previous prompt's <think>
               [BEGIN, 1, END, 2],    # opened and closed -> not thinking
               [END, 3, BEGIN]]       # the last marker opens -> thinking
    ids = torch.tensor([t for p in prompts for t in p] + [BEGIN, 1])  # + a generation request's tokens
    ends = torch.tensor([3, 5, 9, 12])
    assert prompt_thinking_state(ids, ends, BEGIN, END).tolist() == [True, False, False, True]


def test_state_round_trip_through_slots():
    relaxed = RelaxedAcceptance(3, 0.2, BEGIN, END, max_batch_size=4, device="cpu")
    relaxed.thinking_per_slot[2] = True  # a generation request in slot 2 was thinking
    ids = torch.tensor([BEGIN, 1, 2, 9, 9])  # context request (3 tokens, slot 0), then one generation request
    start = relaxed.start_state(ids, torch.tensor([2]), slots=torch.tensor([0, 2]))
    assert start.tolist() == [True, True]
    relaxed.commit(torch.tensor([[END, 0], [4, 0]]), torch.tensor([1, 1]), start, torch.tensor([0, 2]))
    assert relaxed.thinking_per_slot.tolist() == [False, False, True, False, False]
