"""SamplingParams(seed=...) inside CUDA graphs: same request + same seed = same tokens whatever the batch."""
import pytest
import torch

from tllm_spec import Eagle3Config, SamplingParams, trace_cache
from tllm_spec.spec_model import SpecModel

from ..models import tiny_pair

pytestmark = pytest.mark.cuda
PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5], [33, 34, 35, 36], [90, 1, 90]]
MINE = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=77)
OTHERS = [SamplingParams(max_new_tokens=11, temperature=1.0), SamplingParams(max_new_tokens=30),
          SamplingParams(max_new_tokens=20, temperature=0.7, top_k=10, seed=5),
          SamplingParams(max_new_tokens=5, temperature=1.2)]


def _model(rejection: bool, eager: bool) -> SpecModel:
    target, head = tiny_pair("llama")
    cfg = Eagle3Config(speculative_model=str(head), max_draft_len=3, use_rejection_sampling=rejection)
    return SpecModel.from_pretrained(target, cfg, dtype=torch.float32, device="cuda", max_batch_size=8,
                                     enforce_eager=eager, compile_step=False)


@pytest.mark.parametrize("rejection", [False, True])
def test_seeded_request_same_tokens_in_graphs_whatever_the_batch(rejection):
    model = _model(rejection, eager=False)
    alone = model.generate([PROMPTS[0]], [MINE], seed=0)[0].token_ids
    crowd = model.generate([*PROMPTS[1:], PROMPTS[0]], [*OTHERS, MINE], seed=3)[-1].token_ids  # bucket 8
    middle = model.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [OTHERS[0], MINE, OTHERS[1]], seed=9)[1].token_ids
    assert any(key[4] for key in model.runner.graph_runner.graphs), "no graph with per-request streams was captured"
    assert len(alone) == 24
    assert crowd == alone and middle == alone
    eager = _model(rejection, eager=True).generate([PROMPTS[0]], [MINE], seed=4)[0].token_ids
    assert eager == alone  # the graph replays the eager step's draws


def test_seeded_rows_bypass_flashinfer(monkeypatch):
    from tllm_spec.sampling import sampler as sampling

    def refuse(*args, **kwargs):
        raise AssertionError("a step with request seeds reached the FlashInfer sampler")

    monkeypatch.setattr(sampling, "sample_flashinfer", refuse)
    monkeypatch.setenv(trace_cache.TRACE_CACHE_VAR, "0")  # traced here, with the patch: not loaded from disk
    torch._dynamo.reset()  # nor reused from an earlier test in this process: a trace made while traces were cached
    # has no guard on the patched function's identity (trace_cache.py), so it would run the unpatched one
    model = _model(False, eager=False)
    out = model.generate([PROMPTS[0], PROMPTS[1]], [MINE, MINE.model_copy(update={"seed": 78})])
    assert all(len(o.token_ids) == 24 for o in out)
