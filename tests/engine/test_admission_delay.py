"""When waiting requests start, so that arrivals close together share one prefill step: while nothing decodes,
once none has arrived for EngineConfig.admission_window_ms (at most ADMISSION_WINDOW_CAP windows); while requests
decode, once the oldest has waited scheduler_delay_factor times the last prefill step; at once when they fill the
free slots. A request's tokens do not depend on when it joined, and the engine's thread sleeps, not spins, while
it waits."""
from __future__ import annotations

import time

import pytest
import torch
from pydantic import ValidationError

from tllm_spec import Eagle3Config, EngineConfig, SamplingParams, SpecModel

from ..models import tiny_pair

LONG = SamplingParams(max_new_tokens=60, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=12, ignore_eos=True)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


WINDOW = 0.003  # the fixture's admission window, seconds


def load(factor: float, window_ms: float = 0.0) -> SpecModel:
    target, head = tiny_pair("llama")
    return SpecModel.from_pretrained(target, Eagle3Config(speculative_model=str(head), max_draft_len=3),
                                     max_batch_size=4, scheduler_delay_factor=factor, admission_window_ms=window_ms)


@pytest.fixture
def engine_with_clock():
    """(model, engine, clock, outputs): the engine driven on this thread (its loop thread never starts), one step
    per ``step()``, the last prefill step taken to last 1 s of the fake clock."""
    model = load(2.0, WINDOW * 1e3)
    engine = model.engine
    clock = FakeClock()
    outputs: dict[str, list[int]] = {}

    def collect(out):
        outputs.setdefault(out.request_id, []).extend(out.token_ids)
    engine.admission.clock, engine.on_output, engine.should_yield = clock, collect, (lambda: True)
    with torch.inference_mode():
        yield model, engine, clock, outputs


def running_ids(engine) -> set[str]:
    return {r.request_id for r in engine.running}


def start_alone(engine, clock) -> None:
    engine.add(0, [5, 6, 7, 8], LONG, "long")
    clock.now += WINDOW
    engine.step()
    assert running_ids(engine) == {"long"}


def test_an_idle_engine_starts_a_burst_together_once_it_is_over(engine_with_clock):
    _model, engine, clock, _outputs = engine_with_clock
    engine.add(0, [5, 6, 7], SHORT, "a")
    assert engine.idle_wait() == pytest.approx(WINDOW)
    engine.step()
    assert not engine.running
    clock.now += 0.002
    engine.add(1, [8, 9], SHORT, "b")  # the burst goes on: the window restarts from the newest arrival
    clock.now += 0.002
    assert engine.idle_wait() == pytest.approx(0.001)
    engine.step()
    assert not engine.running
    clock.now += 0.001
    assert engine.idle_wait() == 0.0
    engine.step()
    assert running_ids(engine) == {"a", "b"}


def test_an_announced_request_holds_an_idle_engine(engine_with_clock):
    """A request a server has begun reading (EngineLoop.announce) keeps the idle engine waiting for it, within the
    cap; settled, the engine starts once the window is quiet."""
    model, engine, clock, _outputs = engine_with_clock
    announcement = model.loop.announce()
    engine.add(0, [5, 6, 7], SHORT, "a")
    clock.now += WINDOW * 2
    assert engine.idle_wait() == pytest.approx(WINDOW)  # quiet, but one is on its way
    announcement.settle()
    announcement.settle()  # once only
    assert engine.admission.num_incoming() == 0 and engine.idle_wait() == 0.0
    engine.step()
    assert running_ids(engine) == {"a"}


def test_an_endless_burst_starts_after_the_cap(engine_with_clock, monkeypatch):
    monkeypatch.setattr("tllm_spec.engine.admission.ADMISSION_WINDOW_CAP", 2)
    _model, engine, clock, _outputs = engine_with_clock
    engine.add(0, [5], SHORT, "a")
    for i in range(1, 3):  # arrivals every 2/3 window: never quiet for a whole one
        clock.now += WINDOW * 2 / 3
        engine.add(i, [5 + i], SHORT, f"r{i}")
    assert engine.idle_wait() == pytest.approx(WINDOW * 2 / 3)  # the cap (2 windows after "a"), not quiet
    clock.now += WINDOW * 2 / 3 - 1e-6
    assert engine.idle_wait() > 0.0
    clock.now += 2e-6
    assert engine.idle_wait() == 0.0 and engine.admission.due(engine.waiting, engine.running)


def test_a_full_batch_of_arrivals_starts_at_once(engine_with_clock):
    _model, engine, _clock, _outputs = engine_with_clock
    for i in range(4):  # max_batch_size
        engine.add(i, [5 + i], SHORT, f"r{i}")
    assert engine.idle_wait() == 0.0
    engine.step()
    assert len(engine.running) == 4


def test_the_engine_thread_sleeps_through_the_window():
    """Through the real loop: a lone request starts one window after it arrived, and its tokens are unchanged."""
    model = load(0.0, window_ms=300.0)
    expected = load(0.0).generate([[9, 10, 11]], SHORT)[0]
    stream = model.generate_stream([9, 10, 11], SHORT)
    start = time.perf_counter()
    first = next(iter(stream))
    waited = time.perf_counter() - start
    assert 0.25 <= waited and first.token_ids
    assert first.token_ids + [t for o in stream for t in o.token_ids] == expected.token_ids


def test_a_request_waits_while_others_decode_then_joins(engine_with_clock):
    _model, engine, clock, outputs = engine_with_clock
    start_alone(engine, clock)
    engine.admission.prefill_seconds = 1.0
    engine.add(1, [9, 10, 11], SHORT, "late")
    for _ in range(3):
        engine.step()
        assert running_ids(engine) == {"long"} and [r.request_id for r in engine.waiting] == ["late"]
    clock.now += 1.99  # the factor is 2: not yet
    engine.step()
    assert "late" not in running_ids(engine)
    clock.now += 0.01
    engine.step()
    assert running_ids(engine) == {"long", "late"} and not engine.waiting
    while engine.running:
        engine.step()
    alone = load(0.0).generate([[9, 10, 11]], SHORT)[0]
    assert outputs["late"] == alone.token_ids  # greedy tokens do not depend on when the request joined


def test_waiting_requests_that_fill_the_free_slots_join_at_once(engine_with_clock):
    _model, engine, clock, _outputs = engine_with_clock
    start_alone(engine, clock)
    engine.admission.prefill_seconds = 1.0
    engine.add(1, [9, 10, 11], SHORT, "a")
    engine.add(2, [12, 13], SHORT, "b")
    engine.step()
    assert running_ids(engine) == {"long"}  # 2 waiting, 3 slots free
    engine.add(3, [14], SHORT, "c")
    engine.step()  # 3 waiting fill the 3 free slots: no reason to wait
    assert running_ids(engine) == {"long", "a", "b", "c"} and not engine.waiting


def test_factor_zero_admits_at_once():
    model = load(0.0, window_ms=0.0)
    engine = model.engine
    engine.on_output, engine.should_yield = (lambda out: None), (lambda: True)
    with torch.inference_mode():
        engine.add(0, [5, 6, 7, 8], LONG, "long")
        engine.step()
        engine.admission.prefill_seconds = 1e9
        engine.add(1, [9, 10, 11], SHORT, "late")
        engine.step()
        assert {r.request_id for r in engine.running} == {"long", "late"}


def test_the_prefill_step_time_is_measured(engine_with_clock):
    _model, engine, clock, _outputs = engine_with_clock
    assert engine.admission.prefill_seconds == 0.0
    engine.add(0, [5, 6, 7, 8], SHORT, "a")
    clock.now += WINDOW
    engine.step()
    assert engine.admission.prefill_seconds > 0.0


@pytest.mark.parametrize("field", ["scheduler_delay_factor", "admission_window_ms"])
@pytest.mark.parametrize("value", [-0.1, float("nan"), 1e4])
def test_bad_values_are_refused(field, value):
    with pytest.raises(ValidationError, match=field):
        EngineConfig(**{field: value})


def test_steps_run_ahead_while_a_request_waits_to_be_due(engine_with_clock, monkeypatch):
    """On the graphed path (replayed eagerly on the CPU), a request that waits for its delay does not stop the
    decoders' steps ahead: they go on until it is due, then it joins at the next step boundary; its tokens are
    unchanged."""
    from tllm_spec.engine.cuda_graphs import CUDAGraphRunner

    model, engine, clock, outputs = engine_with_clock
    model.runner.graph_runner = model.runner.new_graph_runner()
    launched, run_next = [0], CUDAGraphRunner.run_next

    def counting(self):
        launched[0] += 1
        if launched[0] == 4:
            clock.now += 2.0  # the factor is 2: "late" is due from the next step boundary
        return run_next(self)
    monkeypatch.setattr(CUDAGraphRunner, "run_next", counting)
    engine.should_yield = lambda: False
    start_alone(engine, clock)
    engine.admission.prefill_seconds = 1.0
    engine.add(1, [9, 10, 11], SHORT, "late")
    engine.step()
    assert launched[0] == 4 and [r.request_id for r in engine.waiting] == ["late"]
    engine.step()
    assert running_ids(engine) == {"long", "late"}
    while engine.running:
        engine.step()
    alone = load(0.0).generate([[9, 10, 11]], SHORT)[0]
    assert outputs["late"] == alone.token_ids


def test_the_loop_takes_new_requests_between_steps_ahead_and_holds_other_news():
    """EngineLoop's ``should_yield``: a plain new request joins the queue and the steps ahead go on; an abort,
    a request that restarts the random stream or one that needs a grammar is held for the step boundary."""
    model = load(2.0)
    loop, engine = model.loop, model.engine
    quiet = SamplingParams(max_new_tokens=4)
    loop._inbox.put(("add", [("a", 0, [5, 6], quiet)], lambda out: None, None))
    assert engine.should_yield() is False and [r.request_id for r in engine.waiting] == ["a"]
    for message in [("abort", "a"), ("add", [("b", 1, [7], quiet)], lambda out: None, 3),
                    ("add", [("c", 2, [7], quiet.model_copy(update={"guided_decoding": {"regex": "x"}}))],
                     lambda out: None, None)]:
        loop._inbox.put(message)
        assert engine.should_yield() is True and loop._held is message and loop._inbox.empty()
        loop._held = None
    assert [r.request_id for r in engine.waiting] == ["a"]
