"""SamplingParams(seed=...): a request's own random stream, independent of the rest of the batch."""
import pytest
import torch

from tllm_spec import Eagle3Config, SamplingParams
from tllm_spec.sampling import rng
from tllm_spec.spec_model import SpecModel

from ..models import tiny_pair

PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5], [33, 34, 35, 36], [90, 1, 90]]
MINE = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
OTHERS = [SamplingParams(max_new_tokens=11, temperature=1.0), SamplingParams(max_new_tokens=7),
          SamplingParams(max_new_tokens=20, temperature=0.7, top_k=10, seed=99),
          SamplingParams(max_new_tokens=5, temperature=1.2)]


def _model(kind: str, max_batch_size: int = 4) -> SpecModel:
    target, head = tiny_pair("llama")
    spec = None if kind == "plain" else Eagle3Config(speculative_model=str(head), max_draft_len=3,
                                                       use_rejection_sampling=kind == "rejection")
    return SpecModel.from_pretrained(target, spec, max_batch_size=max_batch_size)


@pytest.mark.parametrize("kind", ["strict", "rejection", "plain"])
def test_same_seed_same_tokens_whatever_the_batch(kind):
    model = _model(kind)
    alone = model.generate([PROMPTS[0]], [MINE], seed=0)[0].token_ids
    first = model.generate(PROMPTS[:3], [MINE, *OTHERS[:2]], seed=7)[0].token_ids
    last = model.generate([*PROMPTS[1:4], PROMPTS[0]], [*OTHERS[1:4], MINE], seed=11)[3].token_ids
    assert len(alone) == 16
    assert first == alone and last == alone
    # admitted late (two slots, four requests ahead of it): its steps line up with other requests' steps
    queued = _model(kind, max_batch_size=2)
    late = queued.generate([*PROMPTS[1:5], PROMPTS[0]], [*OTHERS, MINE], seed=3)[4].token_ids
    assert late == alone


@pytest.mark.parametrize("kind", ["strict", "rejection"])
def test_different_seeds_differ(kind):
    model = _model(kind)
    outs = model.generate([PROMPTS[0]] * 3, [MINE, MINE.model_copy(update={"seed": 1235}),
                                              MINE.model_copy(update={"seed": 2**62 + 1234})])
    assert outs[0].token_ids != outs[1].token_ids
    assert outs[0].token_ids != outs[2].token_ids  # the seed's high bits count too
    twins = model.generate([PROMPTS[0]] * 2, [MINE, MINE])
    assert twins[0].token_ids == twins[1].token_ids  # same request, same seed, side by side


def test_unseeded_requests_keep_the_batch_stream():
    model = _model("strict")
    params = [MINE.model_copy(update={"seed": None}), OTHERS[0]]
    a = model.generate(PROMPTS[:2], params, seed=5)
    b = model.generate(PROMPTS[:2], params, seed=5)
    c = model.generate(PROMPTS[:2], params, seed=6)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]  # the generate call's seed reproduces them
    assert a[0].token_ids != c[0].token_ids


def test_per_row_streams_do_not_depend_on_the_other_rows():
    seeds, offsets = torch.tensor([3, 8, 3, 2**40]), torch.tensor([10, 10, -1, 10])
    together = rng.uniform(seeds, offsets, (4, 50), salt=5)
    for row in range(4):
        alone = rng.uniform(seeds[row:row + 1], offsets[row:row + 1], (1, 50), salt=5)
        assert torch.equal(together[row], alone[0])
    assert not torch.equal(together[0], together[2])  # the offset counts
    assert not torch.equal(together[0], rng.uniform(seeds, offsets, (4, 50), salt=6)[0])  # the salt counts


def test_batch_stream_unchanged_for_a_single_seed():
    # [1] seed/offset: one stream over the flat index, as before per-row streams existed
    draws = rng.uniform(torch.tensor([7]), torch.tensor([0]), (3, 5))
    assert torch.equal(draws.flatten(), rng.uniform(torch.tensor([7]), torch.tensor([0]), (15,)))
    assert not torch.equal(draws[0], draws[1])


def test_seed_field_is_validated():
    with pytest.raises(ValueError):
        SamplingParams(seed=-1)
    with pytest.raises(ValueError):
        SamplingParams(seed=2**63)
