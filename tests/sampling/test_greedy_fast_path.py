"""All-greedy steps take a plain argmax: no sampler, no rejection sampler, same tokens."""
import pytest

from tllm_spec import Eagle3Config, SamplingParams, SpecMetadata
from tllm_spec.drafts import base
from tllm_spec.sampling import sampler as sampling
from tllm_spec.spec_model import SpecModel

from ..models import hf_greedy, tiny_pair

PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5]]
GREEDY = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=9, top_k=1, temperature=0.8),
          SamplingParams(max_new_tokens=14, seed=3)]  # greedy whatever the seed


@pytest.fixture
def sampler_calls(monkeypatch):
    """Counts calls of the sampling kernels the workers use."""
    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(sampling, "sample", spy("sample", sampling.sample))
    monkeypatch.setattr(sampling, "target_probs", spy("target_probs", sampling.target_probs))
    monkeypatch.setattr(base, "rejection_sample", spy("rejection_sample", base.rejection_sample))
    return calls


def _model(rejection: bool) -> tuple[object, SpecModel]:
    target, head = tiny_pair("llama")
    cfg = Eagle3Config(speculative_model=str(head), max_draft_len=3, use_rejection_sampling=rejection)
    return target, SpecModel.from_pretrained(target, cfg, max_batch_size=3)


@pytest.mark.parametrize("rejection", [False, True])
def test_all_greedy_batch_never_calls_a_sampler(sampler_calls, rejection):
    target, model = _model(rejection)
    outs = model.generate(PROMPTS, GREEDY)
    assert sampler_calls == []
    for prompt, p, out in zip(PROMPTS, GREEDY, outs):
        assert out.token_ids == hf_greedy(target, prompt, p.max_new_tokens)


@pytest.mark.parametrize("rejection", [False, True])
def test_fast_path_gives_the_tokens_of_the_sampling_path(monkeypatch, sampler_calls, rejection):
    _, model = _model(rejection)
    fast = [o.token_ids for o in model.generate(PROMPTS, GREEDY)]
    prepare = SpecMetadata.prepare

    def without_fast_path(self, params, context_lens, *draft_lens):
        prepare(self, params, context_lens, *draft_lens)
        self.all_greedy = False

    monkeypatch.setattr(SpecMetadata, "prepare", without_fast_path)
    slow = [o.token_ids for o in model.generate(PROMPTS, GREEDY)]
    assert "sample" in sampler_calls  # the spy sees the sampling path when it runs
    assert slow == fast


def test_one_sampled_request_turns_the_sampler_on(sampler_calls):
    _, model = _model(True)
    model.generate(PROMPTS[:2], [GREEDY[0], SamplingParams(max_new_tokens=6, temperature=1.0)])
    assert {"sample", "target_probs", "rejection_sample"} <= set(sampler_calls)


def test_the_step_flag_is_known_on_the_host():
    meta = SpecMetadata(4, 3, 16, "cpu")
    meta.prepare([SamplingParams(), SamplingParams(top_k=1, temperature=1.0)], [2])
    assert meta.variant == (True, False, 0)
    meta.prepare([SamplingParams(), SamplingParams(temperature=0.5, seed=1)], [2])
    assert meta.variant == (False, True, 0)
    meta.prepare([SamplingParams(temperature=0.5), SamplingParams(seed=4)], [])  # a greedy seed does not count
    assert meta.variant == (False, False, 0)
