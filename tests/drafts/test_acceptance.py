"""Golden acceptance cases on an 8-token vocabulary (greedy target rows, so target = argmax of the row)."""
import pytest
import torch

from tllm_spec import SamplingParams, SpecMetadata
from tllm_spec.drafts.base import SpecWorkerBase

V = 8
GREEDY = SamplingParams(temperature=0.0)


class _Worker(SpecWorkerBase):
    def forward(self):  # the base class under test needs no draft network
        raise NotImplementedError


def row(token: int) -> list[float]:
    """Logits whose argmax is ``token``."""
    logits = [0.0] * V
    logits[token] = 5.0
    return logits


def run(logit_rows, drafts, context_lens, num_gen, k, monkeypatch=None):
    meta = SpecMetadata(max_num_requests=8, max_draft_len=k, vocab_size=V, device="cpu")
    meta.prepare([GREEDY] * (len(context_lens) + num_gen), context_lens)
    worker = _Worker(max_draft_len=k)
    logits = torch.tensor(logit_rows)
    target = worker.sample_target(logits, meta)
    return worker.accept_tokens(target, torch.tensor(drafts, dtype=torch.int64).view(num_gen, k),
                                len(context_lens), meta)


@pytest.fixture(autouse=True)
def _no_forcing(monkeypatch):
    monkeypatch.delenv("TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS", raising=False)


def test_generation_only_k3_none_partial_all():
    logit_rows = [
        row(1), row(2), row(3), row(4),  # req 0: drafts 5 6 7 -> first draft wrong: accept none
        row(2), row(3), row(4), row(5),  # req 1: drafts 2 3 0 -> two right, third wrong
        row(6), row(7), row(0), row(1),  # req 2: drafts 6 7 0 -> all right, bonus 1
    ]
    drafts = [[5, 6, 7], [2, 3, 0], [6, 7, 0]]
    tokens, n = run(logit_rows, drafts, [], 3, 3)
    assert n.tolist() == [1, 3, 4]
    assert tokens[0, :1].tolist() == [1]  # correction token
    assert tokens[1, :3].tolist() == [2, 3, 4]  # two accepted drafts + correction
    assert tokens[2].tolist() == [6, 7, 0, 1]  # three accepted drafts + bonus


def test_context_only_accepts_sampled_token():
    logit_rows = [row(3), row(7)]  # last token of each prompt
    tokens, n = run(logit_rows, [], [5, 2], 0, 3)
    assert n.tolist() == [1, 1]
    assert tokens[:, 0].tolist() == [3, 7]


def test_mixed_batch_k1():
    logit_rows = [
        row(4),          # context request: its sampled token
        row(2), row(5),  # gen req 0: draft 2 right -> accept, bonus 5
        row(1), row(6),  # gen req 1: draft 3 wrong -> correction 1
    ]
    tokens, n = run(logit_rows, [[2], [3]], [4], 2, 1)
    assert n.tolist() == [1, 2, 1]
    assert tokens[0, 0] == 4
    assert tokens[1].tolist() == [2, 5]
    assert tokens[2, 0] == 1


def test_later_match_after_mismatch_is_not_accepted():
    logit_rows = [row(1), row(2), row(3), row(4)]  # drafts 0 2 3: first wrong, later ones right
    tokens, n = run(logit_rows, [[0, 2, 3]], [], 1, 3)
    assert n.tolist() == [1] and tokens[0, 0] == 1


def test_prepare_next_new_tokens_takes_last_accepted():
    new_tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    nxt = SpecWorkerBase._prepare_next_new_tokens(new_tokens, torch.tensor([4, 2]), torch.tensor([[9, 9, 9],
                                                                                                 [8, 8, 8]]))
    assert nxt.tolist() == [[4, 9, 9, 9], [6, 8, 8, 8]]


def test_prepare_context_input_ids_pairs_each_position_with_next_token():
    # prompt [10 11 12] (context) then a generation request's K+1 = 2 tokens [20 21]
    input_ids = torch.tensor([10, 11, 12, 20, 21])
    gather_ids = torch.tensor([2, 3, 4])
    target = torch.tensor([13, 30, 31])
    out = SpecWorkerBase._prepare_context_input_ids(input_ids, gather_ids, target)
    assert out.tolist() == [11, 12, 13, 30, 31]
