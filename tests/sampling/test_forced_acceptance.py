import pytest
import torch

from tllm_spec import SamplingParams, SpecMetadata
from tllm_spec.drafts.base import SpecWorkerBase
from tllm_spec.sampling.forcing import ENV_VAR, forced_num_accepted, read_forced_num_accepted


class _Worker(SpecWorkerBase):
    def forward(self):
        raise NotImplementedError


def _set_env(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, value)


def _accept(monkeypatch, value, k=3, num_ctx=1, num_gen=2, first_drafts_right=0):
    """(new_tokens, num_accepted) of a strict step whose first ``first_drafts_right`` drafts match the target."""
    _set_env(monkeypatch, value)
    worker = _Worker(max_draft_len=k)
    meta = SpecMetadata(8, k, 8, "cpu")
    meta.prepare([SamplingParams()] * (num_ctx + num_gen), [3] * num_ctx)
    target = torch.arange(num_ctx + num_gen * (k + 1)) % 8
    gen_target = target[num_ctx:].view(num_gen, k + 1)
    drafts = (gen_target[:, :k] + 1) % 8  # every draft wrong ...
    drafts[:, :first_drafts_right] = gen_target[:, :first_drafts_right]  # ... but the first few
    return worker.accept_tokens(target, drafts, num_ctx, meta)


@pytest.mark.parametrize("value,expected", [("1", 2), ("2", 3), ("3", 4), ("7", 4), ("3.0", 4), ("0.0001", 1)])
def test_integer_values_cap_at_k(monkeypatch, value, expected):
    n = _accept(monkeypatch, value)[1]
    assert n[0] == 1  # context row untouched
    assert n[1:].tolist() == [expected, expected]


@pytest.mark.parametrize("value", [None, "", "  ", "0", "0.0", "-0"])
def test_unset_empty_or_zero_means_off(monkeypatch, value):
    # TensorRT-LLM semantics: 0 is "not forced", so strict acceptance decides (2 drafts right -> 3 tokens)
    assert _accept(monkeypatch, value, first_drafts_right=2)[1].tolist() == [1, 3, 3]
    assert read_forced_num_accepted({} if value is None else {ENV_VAR: value}) is None


@pytest.mark.parametrize("garbage", ["abc", "1,5", "-1", "nan", "inf"])
def test_garbage_warns_and_means_off(monkeypatch, garbage):
    with pytest.warns(UserWarning, match=ENV_VAR):
        assert read_forced_num_accepted({ENV_VAR: garbage}) is None
    with pytest.warns(UserWarning, match=ENV_VAR):
        assert _accept(monkeypatch, garbage, first_drafts_right=1)[1].tolist() == [1, 2, 2]


def test_forced_rows_hold_the_target_tokens_on_the_strict_path(monkeypatch):
    tokens, n = _accept(monkeypatch, "3")  # every draft wrong, all K forced
    target = torch.arange(1 + 2 * 4) % 8
    assert n.tolist() == [1, 4, 4]
    assert tokens[1:].tolist() == target[1:].view(2, 4).tolist()


def _rejection_step(monkeypatch, value, k=3):
    """One rejection-sampling step at T = 1 where every draft is rejected at once: the drafts (token 7) have
    target probability 0 and token 0 is impossible too. Returns (new_tokens, num_accepted, strict targets)."""
    _set_env(monkeypatch, value)
    worker = _Worker(max_draft_len=k, use_rejection_sampling=True)
    worker.allocate_state(num_slots=3, vocab_size=8, device=torch.device("cpu"))
    worker.draft_probs[:, :, 7] = 1.0  # the drafts were drawn from a one-hot on token 7
    meta = SpecMetadata(8, k, 8, "cpu")
    meta.prepare([SamplingParams(temperature=1.0)] * 2, [])
    logits = torch.zeros(2 * (k + 1), 8)
    logits[:, [0, 7]] = float("-inf")
    target = torch.tensor([3, 4, 5, 6, 2, 3, 4, 5])  # the step's strict target samples, one per row
    drafts = torch.full((2, k), 7)
    tokens, n = worker.accept_tokens(target, drafts, 0, meta, logits, torch.tensor([0, 1]))
    return tokens, n, target.view(2, k + 1)


def test_rejection_path_unforced_emits_one_correction(monkeypatch):
    tokens, n, _ = _rejection_step(monkeypatch, None)
    assert n.tolist() == [1, 1]
    assert all(t not in (0, 7) for t in tokens[:, 0].tolist())


def test_forced_rows_hold_the_target_tokens_on_the_rejection_path(monkeypatch):
    tokens, n, target = _rejection_step(monkeypatch, "3")
    assert n.tolist() == [4, 4]
    assert all(t not in (0, 7) for t in tokens[:, 0].tolist())  # the correction, drawn from the target
    assert tokens[:, 1:].tolist() == target[:, 1:].tolist()  # then the target's own samples, not token 0


def test_fractional_value_frequency():
    # 1.25 drafts: accept 1 draft with p = 0.75, 2 drafts with p = 0.25 (n = 2 or 3 with the bonus)
    seed, offset = torch.tensor([11]), torch.tensor([0])
    draws = []
    for _ in range(200):
        draws.append(forced_num_accepted(1.25, 3, 50, seed, offset))  # advances the seed
    n = torch.cat(draws)
    assert set(n.unique().tolist()) == {2, 3}
    freq = (n == 3).float().mean().item()
    # 10,000 Bernoulli(0.25) draws: standard error 0.0043; 5 sigma tolerance
    assert abs(freq - 0.25) < 0.022


def test_fraction_near_k_still_capped():
    n = forced_num_accepted(2.9, 3, 1000, torch.tensor([1]), torch.tensor([0]))
    assert n.max() == 4 and n.min() == 3


def test_a_new_value_reaches_the_allocated_device_count(monkeypatch):
    """The step reads the forced count from a tensor (moved to the device with the state), which every new
    value (set as refresh_forced_acceptance does) updates in place."""
    _set_env(monkeypatch, "1.5")
    worker = _Worker(max_draft_len=3)
    assert worker.forcing and worker.forced_value.item() == 1.5
    worker.allocate_state(num_slots=3, vocab_size=8, device=torch.device("cpu"))
    value = worker.forced_value
    assert value.item() == 1.5
    worker.forced_num_accepted = 3.0
    assert worker.forced_value is value and value.item() == 3.0
    n = forced_num_accepted(value, 3, 5, torch.tensor([1]), torch.tensor([0]))
    assert n.tolist() == [4] * 5
    worker.forced_num_accepted = None
    assert not worker.forcing and worker.forced_num_accepted is None
