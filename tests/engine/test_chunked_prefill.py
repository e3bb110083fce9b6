"""Chunked prefill (EngineConfig.max_num_batched_tokens): a prompt enters over several steps, running requests keep
decoding meanwhile, and nothing a request sees changes: its tokens, acceptance, logprobs and every draft the step
proposes for it equal those of the whole prompt in one step (EAGLE-3, MTP-Eagle, per-step MTP, vanilla MTP with
1 and 3 modules; greedy and seeded requests; prompts ending on a chunk boundary and not)."""
from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from tllm_spec import Eagle3Config, EngineConfig, MTPConfig, SamplingParams
from tllm_spec.drafts.mtp.model import save_random_mtp_weights
from tllm_spec.engine.cuda_graphs import CUDAGraphRunner
from tllm_spec.engine.engine import Engine
from tllm_spec.engine.request import Request, StreamOutput
from tllm_spec.engine.runner import ModelRunner
from tllm_spec.model.kv_cache import KVCache
from tllm_spec.engine.scheduler import schedule_chunks
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.random_models import save_random_target, target_config

from ..models import hf_greedy, hf_model, tiny_pair

NO_CHUNKS = 10**6
# 23 tokens: 5 does not divide it; 10: two chunks of 5 exactly; 14: two chunks of 7 exactly; 1 and 5: one chunk
PROMPTS = [list(range(3, 26)), [12, 8, 5, 6, 7, 1, 2, 3, 4, 9], [60, 61, 62, 63, 1], [33],
           [90, 1, 90, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
PARAMS = [SamplingParams(max_new_tokens=14, ignore_eos=True, logprobs=2),
          SamplingParams(max_new_tokens=9, ignore_eos=True),
          SamplingParams(max_new_tokens=17, ignore_eos=True, temperature=0.9, top_p=0.95, seed=7),
          SamplingParams(max_new_tokens=5, ignore_eos=True),
          SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=1234)]
MTP_MODES = {
    "mtp_eagle": MTPConfig(num_nextn_predict_layers=1, max_draft_len=3),
    "mtp_per_step": MTPConfig(num_nextn_predict_layers=2, max_draft_len=3, mtp_layer_selection="per_step"),
    "vanilla1": MTPConfig(num_nextn_predict_layers=1, use_mtp_vanilla=True),
    "vanilla3": MTPConfig(num_nextn_predict_layers=3, use_mtp_vanilla=True),
}


@functools.cache
def mtp_target() -> Path:
    root = Path(tempfile.mkdtemp(prefix="tllm_spec_chunked_mtp_"))
    save_random_target(root, target_config("llama", vocab_size=97), seed=0)
    save_random_mtp_weights(root, 3, "deepseek", seed=1)
    return root


def load(mode: str, budget: int, max_batch_size: int = 3) -> SpecModel:
    """Admission at once (no window, no delay): the tests drive the engine step by step."""
    engine = dict(max_batch_size=max_batch_size, max_num_batched_tokens=budget, admission_window_ms=0.0,
                  scheduler_delay_factor=0.0)
    if mode in MTP_MODES:
        return SpecModel.from_pretrained(mtp_target(), MTP_MODES[mode], **engine)
    target, head = tiny_pair("llama")
    spec = Eagle3Config(speculative_model=str(head), max_draft_len=3, use_rejection_sampling=mode == "rejection")
    return SpecModel.from_pretrained(target, spec, **engine)


@pytest.fixture
def trace(monkeypatch) -> dict:
    """Per request, every step's (accepted tokens, next input = [last token, next drafts]); and every step's
    context chunks as the runner got them (lens, starts, number of requests in the step)."""
    seen: dict = {"steps": [], "chunks": []}
    accept, step = Request.accept, ModelRunner.step

    def recording_accept(self, tokens, logprobs=None):
        seen["steps"].append((self.request_id, list(tokens), list(self.next_input)))
        return accept(self, tokens, logprobs)

    def recording_step(self, ids, positions, slots, drafts, params, context_lens, *rest):
        seen["chunks"].append((context_lens, rest[2] if len(rest) > 2 else (), len(params)))
        return step(self, ids, positions, slots, drafts, params, context_lens, *rest)
    monkeypatch.setattr(Request, "accept", recording_accept)
    monkeypatch.setattr(ModelRunner, "step", recording_step)
    return seen


def run(model: SpecModel, trace: dict, prompts=PROMPTS, params=PARAMS) -> tuple[list, list, list]:
    """(tokens, finish reason and acceptance per request; every step's accepted tokens and next input per request;
    logprobs per request)."""
    trace["steps"].clear()
    trace["chunks"].clear()
    outs = model.generate(prompts, params, seed=3)
    per_request: dict[str, list] = {}
    for request_id, tokens, next_input in trace["steps"]:
        per_request.setdefault(request_id, []).append((tokens, next_input))
    results = [(o.token_ids, o.finish_reason, o.stats.accepted_per_step) for o in outs]
    return results, sorted(per_request.values()), [o.logprobs for o in outs]


@pytest.mark.parametrize("mode", [  # vanilla3: three seconds, in the second CI command (vanilla1 stays here)
    "eagle3", "rejection", *(pytest.param(m, marks=pytest.mark.slow) if m == "vanilla3" else m for m in MTP_MODES)])
def test_chunked_prefill_changes_nothing_a_request_sees(mode, trace):
    """Three slots for five requests: prompts are chunked while earlier requests decode; greedy and seeded
    sampled requests give the same tokens, acceptance, logprobs and drafts at every step."""
    whole = run(load(mode, NO_CHUNKS), trace)
    assert not any(any(starts) for _, starts, _ in trace["chunks"])
    for budget in (5, 7):
        chunked = run(load(mode, budget), trace)
        assert max(n for lens, _, _ in trace["chunks"] for n in lens) <= budget
        assert any(any(starts) and num > len(lens) for lens, starts, num in trace["chunks"])  # mixed with decoding
        assert chunked[:2] == whole[:2], f"budget {budget}"
        assert chunked[2] == [None if lp is None else pytest.approx(lp, abs=1e-5) for lp in whole[2]]
    target = mtp_target() if mode in MTP_MODES else tiny_pair("llama")[0]
    for prompt, p, (tokens, *_) in zip(PROMPTS, PARAMS, whole[0]):
        if p.is_greedy:
            assert tokens == hf_greedy(target, prompt, p.max_new_tokens)


def test_chunks_mix_with_decoding_requests(trace):
    """A long prompt is prefilled 5 tokens a step while the requests already running decode in the same steps."""
    model = load("eagle3", 5)
    run(model, trace, [[1, 2, 3], [4, 5, 6, 7], list(range(10, 40))],
        [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 3)
    # (chunk lengths, chunk starts, requests in the step): FIFO, 5 prompt tokens a step, the others decoding
    assert trace["chunks"][:9] == [((3, 2), (0, 0), 2), ((2, 3), (2, 0), 3), ((5,), (3,), 3), ((5,), (8,), 3),
                                   ((5,), (13,), 3), ((5,), (18,), 3), ((5,), (23,), 3), ((2,), (28,), 3),
                                   ((), (), 3)]


def test_vanilla_mtp_chunks_stop_short_of_the_prompt_end(trace):
    """Module k at a chunk's last position reads prompt token p + k: a partial chunk leaves N tokens after it."""
    run(load("vanilla3", 5), trace, [list(range(1, 13))], [SamplingParams(max_new_tokens=4)])
    assert [lens for lens, _, _ in trace["chunks"]][:4] == [(5,), (4,), (3,), ()]  # 12 = 5 + 4 (3 left) + 3


def test_relaxed_acceptance_carries_the_thinking_state_across_chunks(trace):
    """The prompt opens <think> in its first chunk only; the last chunk (no marker) must still start thinking. The
    token the first (partial) chunk samples and discards is </think>: it must not close thinking."""
    think, first = 90, [5, 6, 90, 7]
    with torch.no_grad():
        end = int(hf_model(mtp_target())(torch.tensor([first])).logits[0, -1].argmax())
    assert end != think
    spec = MTPConfig(num_nextn_predict_layers=1, max_draft_len=3, use_relaxed_acceptance_for_thinking=True,
                     relaxed_topk=5, relaxed_delta=1.0, begin_thinking_phase_token=think,
                     end_thinking_phase_token=end)
    rest = [t for t in range(8, 30) if t != end][:13]
    prompts = [first + rest, [3, 4, 5, 6, 7, 8, 9, 10]]
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True)] * 2

    def generate(budget: int) -> list:
        model = SpecModel.from_pretrained(mtp_target(), spec, max_batch_size=2, max_num_batched_tokens=budget)
        return run(model, trace, prompts, params)
    whole = generate(NO_CHUNKS)
    assert whole[0][0][0] != hf_greedy(mtp_target(), prompts[0], 16)  # relaxed acceptance did change the output
    assert generate(4)[:2] == whole[:2]


def test_a_running_request_emits_every_step_while_a_long_prompt_is_chunked():
    model = load("eagle3", 5)
    engine = Engine(model.runner)
    outputs: list[StreamOutput] = []
    engine.on_output = outputs.append
    engine.add(0, [1, 2, 3, 4], SamplingParams(max_new_tokens=100, ignore_eos=True), "running")
    engine.step()  # its prompt (4 tokens) in one step
    engine.add(1, list(range(5, 45)), SamplingParams(max_new_tokens=3, ignore_eos=True), "long")  # 40 tokens
    long = engine.waiting[0]
    for chunk in range(1, 8):  # 7 partial chunks of 5 tokens: one output of the running request a step
        outputs.clear()
        engine.step()
        assert long.num_cached == 5 * chunk and [o.request_id for o in outputs] == ["running"]
        assert outputs[0].token_ids
    outputs.clear()
    engine.step()  # the last chunk: the long request's first token
    assert long.num_cached == 40 and sorted(o.request_id for o in outputs) == ["long", "running"]
    for request_id in ("running", "long"):
        engine.abort(request_id)
    engine.step()


def _long_prompt_engine(draft: str) -> tuple[Engine, KVCache, tuple[int, int], list[StreamOutput]]:
    """An engine (chunks of 5) holding a 30-token prompt after its first chunk; the pool's free (pages, slots)
    before it was added; the outputs it hands out."""
    model = load(draft, 5)
    kv = model.runner.kv_cache
    baseline = (kv.num_free_pages, kv.num_free_slots)
    engine = Engine(model.runner)
    outputs: list[StreamOutput] = []
    engine.on_output = outputs.append
    engine.add(0, list(range(1, 31)), SamplingParams(max_new_tokens=8), "long")
    engine.step()
    return engine, kv, baseline, outputs


def test_abort_mid_prefill_frees_everything():
    engine, kv, baseline, outputs = _long_prompt_engine("vanilla3")
    engine.step()
    request = engine.running[0]
    assert request.is_context and request.num_cached == 10 and kv.num_free_pages < baseline[0]
    assert engine.abort("long")
    engine.step()
    assert (kv.num_free_pages, kv.num_free_slots) == baseline and not engine.running
    assert [(o.finished, o.token_ids, o.finish_reason) for o in outputs] == [(True, [], "abort")]


def test_a_failing_chunk_frees_everything(monkeypatch):
    engine, kv, baseline, outputs = _long_prompt_engine("eagle3")
    monkeypatch.setattr(ModelRunner, "step", lambda *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        engine.step()
    assert (kv.num_free_pages, kv.num_free_slots) == baseline and not engine.running
    assert outputs[-1].finish_reason == "error"


def test_no_step_runs_ahead_while_a_prompt_chunk_is_pending(monkeypatch):
    """The graphed path (replayed eagerly on the CPU): steps run ahead only once no prompt is left to prefill."""
    model = load("eagle3", 5)
    model.runner.graph_runner = model.runner.new_graph_runner()
    requests: list[Request] = []
    new_request, run_next = Engine._new_request, CUDAGraphRunner.run_next
    pending_when_run_ahead: list[int] = []

    def tracked(self, *args, **kwargs):
        requests.append(new_request(self, *args, **kwargs))
        return requests[-1]

    def counting(self):
        pending_when_run_ahead.append(sum(r.slot >= 0 and r.is_context and not r.finish_reason for r in requests))
        return run_next(self)
    monkeypatch.setattr(Engine, "_new_request", tracked)
    monkeypatch.setattr(CUDAGraphRunner, "run_next", counting)
    prompts, params = [[1, 2, 3], list(range(10, 40))], [SamplingParams(max_new_tokens=40, ignore_eos=True)] * 2
    outs = model.generate(prompts, params)
    assert len(pending_when_run_ahead) > 5 and not any(pending_when_run_ahead)
    target = tiny_pair("llama")[0]
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, 40) for p in prompts]


def test_long_prompts_are_accepted_within_max_seq_len():
    model = load("eagle3", 5)
    long, params = list(range(1, 90)), SamplingParams(max_new_tokens=4)
    assert model.engine.check(long, params) is None  # 89 prompt tokens, 5 a step
    out = model.generate([long], params)[0]
    assert out.finish_reason == "length" and out.token_ids == hf_greedy(tiny_pair("llama")[0], long, 4)


def test_schedule_chunks_takes_prompts_fifo_within_the_budget():
    def request(prompt_len: int, cached: int = 0) -> Request:
        r = Request(0, list(range(prompt_len)), SamplingParams(), frozenset(), 1000, None)
        r.num_cached = cached
        return r
    a, b, c = request(12, 3), request(4), request(30)
    assert [(x.request, x.start, x.length) for x in schedule_chunks([a, b, c], 16, 1)] == \
        [(a, 3, 9), (b, 0, 4), (c, 0, 3)]
    assert [(x.start, x.length) for x in schedule_chunks([c], 8, 3)] == [(0, 8)]
    assert [x.length for x in schedule_chunks([request(10, 1)], 8, 3)] == [6]  # 3 prompt tokens left after it
    assert [x.length for x in schedule_chunks([request(10, 7), c], 2, 3)] == [3]  # the head always progresses
    assert [x.length for x in schedule_chunks([a, request(9)], 10, 3)] == [9, 1]
    assert schedule_chunks([a], 16, 1)[0].next_tokens(1) == ()  # the last chunk of its prompt
    assert schedule_chunks([c], 16, 2)[0].next_tokens(2) == (16, 17)


def test_max_num_batched_tokens_is_validated():
    assert EngineConfig().max_num_batched_tokens == 16384
    with pytest.raises(ValidationError):
        EngineConfig(max_num_batched_tokens=0)
