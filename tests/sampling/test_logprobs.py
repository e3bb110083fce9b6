"""Logprobs inside the step: the row of each emitted token in the flat layout, the packing into int64 columns and
back (bit-exact, -inf included), the width a batch computes, and the sampling-params field."""
import math

import pytest
import torch
from pydantic import ValidationError

from tllm_spec import SamplingParams
from tllm_spec.drafts.metadata import SpecMetadata, sampling_variant
from tllm_spec.one_model import pack_outputs, packed_columns
from tllm_spec.sampling.logprobs import (
    StepLogprobs,
    logprobs_width,
    pack_logprobs,
    token_logprobs,
)

K = 3


def test_each_token_reads_the_row_that_produced_it():
    """One context request, then two generation requests verifying k = 2 drafts: rows 0 | 1 2 3 | 4 5 6. Row r's
    logits put 5.0 on token r (vocabulary 8), so the logprob of token t at row r is high iff t == r."""
    num_ctx = 1
    logits = torch.zeros(7, 8)
    logits[torch.arange(7), torch.arange(7)] = 5.0  # row r: token r most likely
    logits[6, 7] = float("-inf")  # a token a grammar forbids
    new_tokens = torch.tensor([[0, 0, 0],   # context request: its one token from row 0 (columns 1, 2 padding)
                               [1, 2, 6],   # generation request 0: rows 1, 2, 3 (token 6 unlikely at row 3)
                               [4, 5, 6]])  # generation request 1: rows 4, 5, 6
    out = token_logprobs(logits, new_tokens, num_ctx, width=2)
    reference = torch.log_softmax(logits, -1)
    rows = [[0, None, None], [1, 2, 3], [4, 5, 6]]
    expected = [[reference[r, t].item() if r is not None else 0.0 for r, t in zip(row, tokens)]
                for row, tokens in zip(rows, new_tokens.tolist())]
    assert torch.allclose(out["token_logprobs"], torch.tensor(expected))
    assert expected[1][2] < -5 and expected[1][1] > -0.1  # token 6 at row 3: unlikely; token 2 at row 2: likely
    assert out["top_logprob_ids"][:, :, 0].tolist() == [[0, 0, 0], [1, 2, 3], [4, 5, 6]]
    assert out["top_logprobs"].shape == (3, 3, 2) and out["top_logprobs"][0, 1:].eq(0).all()  # context padding
    for b, row in enumerate(rows):
        for j, r in enumerate(row):
            if r is not None:
                assert torch.allclose(out["top_logprobs"][b, j], reference[r].topk(2).values)


def test_width_is_capped_by_the_vocabulary():
    out = token_logprobs(torch.randn(2, 4), torch.tensor([[1], [3]]), 2, width=20)
    assert out["top_logprob_ids"].shape == (2, 1, 4)
    assert sorted(out["top_logprob_ids"][0, 0].tolist()) == [0, 1, 2, 3]


def test_packing_round_trips_bit_exactly():
    g = torch.Generator().manual_seed(0)
    num_requests, k, width, vocab = 4, 2, 5, 50  # a step with fewer drafts than K: positions padded
    values = torch.randn(num_requests, k + 1, generator=g) * 30
    values[0, 0], values[1, 1], values[2, 2] = float("-inf"), -0.0, -1e-30
    tops = torch.randn(num_requests, k + 1, width, generator=g).sort(-1, descending=True).values
    tops[3, 0, -1] = float("-inf")
    ids = torch.stack([torch.randperm(vocab, generator=g)[:width] for _ in range(num_requests * (k + 1))])
    ids = ids.view(num_requests, k + 1, width)  # distinct ids per position, as top-k gives
    out = {"token_logprobs": values, "top_logprob_ids": ids, "top_logprobs": tops}
    columns = pack_logprobs(out, K)
    assert columns.dtype == torch.int64 and columns.shape == (num_requests, (K + 1) * (1 + width))
    step = StepLogprobs.unpack(columns, K)
    for b in range(num_requests):
        chosen, top = step.of(b, k + 1, width)
        assert torch.equal(torch.tensor(chosen).view(torch.int32), values[b].view(torch.int32))  # bits, -0.0 too
        assert [list(t) for t in top] == ids[b].tolist()
        assert torch.equal(torch.tensor([list(t.values()) for t in top]), tops[b])
    assert math.isinf(step.of(0, 1, 0)[0][0]) and step.of(0, 1, 0)[1] == [{}]
    assert StepLogprobs.unpack(columns[:, :0], K) is None


def test_packed_outputs_keep_their_first_columns_and_append_the_logprobs():
    new_tokens = torch.tensor([[7, 8, 0, 0]])
    out = {"new_tokens": new_tokens, "new_tokens_lens": torch.tensor([2]), "next_new_tokens": torch.tensor([[8, 1]])}
    plain = pack_outputs(out, K)
    assert plain.shape[1] == packed_columns(K) == 2 * K + 3
    out.update(token_logprobs(torch.randn(4, 30), new_tokens, 0, width=5))
    wide = pack_outputs(out, K)
    assert wide.shape[1] == packed_columns(K, 5) and torch.equal(wide[:, :2 * K + 3], plain)


def test_a_batch_computes_the_widest_request_rounded_up():
    assert logprobs_width([None, None]) == 0
    assert logprobs_width([0]) == 1 and logprobs_width([None, 1]) == 1
    assert logprobs_width([2, None]) == 5 and logprobs_width([5]) == 5
    assert logprobs_width([6, 1]) == 20 and logprobs_width([20]) == 20


def test_the_width_is_part_of_the_host_known_variant():
    meta = SpecMetadata(4, K, 16, "cpu")
    meta.prepare([SamplingParams(), SamplingParams(logprobs=3)], [2])
    assert meta.variant == (True, False, 5) and meta.logprobs_width == 5
    meta.prepare([SamplingParams(temperature=1.0)], [])
    assert meta.variant == (False, False, 0)
    assert sampling_variant([SamplingParams(logprobs=0), SamplingParams(temperature=1.0, seed=1)]) == (False, True, 1)


@pytest.mark.parametrize("bad", [-1, 21, 2.5])
def test_sampling_params_refuse_a_bad_logprobs(bad):
    with pytest.raises(ValidationError, match="logprobs"):
        SamplingParams(logprobs=bad)
