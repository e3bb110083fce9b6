import pytest
import torch

from tllm_spec import SamplingParams, SpecMetadata
from tllm_spec.forced_acceptance import ENV_VAR, forced_num_accepted, read_forced_num_accepted
from tllm_spec.workers.base import SpecWorkerBase


class _Worker(SpecWorkerBase):
    def forward(self):
        raise NotImplementedError


def _accept(monkeypatch, value, k=3, num_ctx=1, num_gen=2):
    if value is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, value)
    worker = _Worker(max_draft_len=k)
    meta = SpecMetadata(8, k, 8, "cpu")
    meta.prepare([SamplingParams()] * (num_ctx + num_gen), [3] * num_ctx)
    # every draft wrong: strict acceptance alone would accept 1 token per generation request
    target = torch.arange(num_ctx + num_gen * (k + 1)) % 8
    drafts = torch.full((num_gen, k), 7)
    drafts[:, 0] = 6
    return worker.accept_tokens(target, drafts, num_ctx, meta)[1]


@pytest.mark.parametrize("value,expected", [("0", 1), ("1", 2), ("2", 3), ("3", 4), ("7", 4), ("3.0", 4)])
def test_integer_values_cap_at_k(monkeypatch, value, expected):
    n = _accept(monkeypatch, value)
    assert n[0] == 1  # context row untouched
    assert n[1:].tolist() == [expected, expected]


def test_unset_means_strict(monkeypatch):
    assert _accept(monkeypatch, None).tolist() == [1, 1, 1]
    assert read_forced_num_accepted({}) is None
    assert read_forced_num_accepted({ENV_VAR: "  "}) is None


@pytest.mark.parametrize("garbage", ["abc", "-1", "nan", "inf"])
def test_garbage_warns_and_means_zero(monkeypatch, garbage):
    with pytest.warns(UserWarning, match=ENV_VAR):
        assert read_forced_num_accepted({ENV_VAR: garbage}) == 0.0
    with pytest.warns(UserWarning):
        assert _accept(monkeypatch, garbage).tolist() == [1, 1, 1]


def test_fractional_value_frequency():
    # 1.25 drafts: accept 1 draft with p = 0.75, 2 drafts with p = 0.25 (n = 2 or 3 with the bonus)
    seed, offset = torch.tensor([11]), torch.tensor([0])
    draws = []
    for _ in range(200):
        draws.append(forced_num_accepted(1.25, 3, 50, seed, offset))
        seed.add_(1)
    n = torch.cat(draws)
    assert set(n.unique().tolist()) == {2, 3}
    freq = (n == 3).float().mean().item()
    # 10,000 Bernoulli(0.25) draws: standard error 0.0043; 5 sigma tolerance
    assert abs(freq - 0.25) < 0.022


def test_fraction_near_k_still_capped():
    n = forced_num_accepted(2.9, 3, 1000, torch.tensor([1]), torch.tensor([0]))
    assert n.max() == 4 and n.min() == 3
