"""EngineConfig.scheduler_delay_factor: while requests decode, a new one waits (at most the factor times the last
prefill step) so that arrivals close together share one prefill step; it joins at once when nothing decodes or
when the waiting requests fill the free slots; its tokens do not depend on when it joined."""
from __future__ import annotations

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


def load(factor: float) -> SpecModel:
    target, head = tiny_pair("llama")
    return SpecModel.from_pretrained(target, Eagle3Config(speculative_model=str(head), max_draft_len=3),
                                     max_batch_size=4, scheduler_delay_factor=factor)


@pytest.fixture
def engine_with_clock():
    """(model, engine, clock, outputs): the engine driven on this thread (its loop thread never starts), one step
    per ``step()``, the last prefill step taken to last 1 s of the fake clock."""
    model = load(2.0)
    engine = model.engine
    clock = FakeClock()
    outputs: dict[str, list[int]] = {}

    def collect(out):
        outputs.setdefault(out.request_id, []).extend(out.token_ids)
    engine.clock, engine.on_output, engine.should_yield = clock, collect, (lambda: True)
    with torch.inference_mode():
        yield model, engine, clock, outputs


def running_ids(engine) -> set[str]:
    return {r.request_id for r in engine.running}


def test_a_request_waits_while_others_decode_then_joins(engine_with_clock):
    model, engine, clock, outputs = engine_with_clock
    engine.add(0, [5, 6, 7, 8], LONG, "long")
    engine.step()  # nothing decoded: admitted at once
    assert running_ids(engine) == {"long"}
    engine.prefill_seconds = 1.0
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
    model, engine, clock, outputs = engine_with_clock
    engine.add(0, [5, 6, 7, 8], LONG, "long")
    engine.step()
    engine.prefill_seconds = 1.0
    engine.add(1, [9, 10, 11], SHORT, "a")
    engine.add(2, [12, 13], SHORT, "b")
    engine.step()
    assert running_ids(engine) == {"long"}  # 2 waiting, 3 slots free
    engine.add(3, [14], SHORT, "c")
    engine.step()  # 3 waiting fill the 3 free slots: no reason to wait
    assert running_ids(engine) == {"long", "a", "b", "c"} and not engine.waiting


def test_factor_zero_admits_at_once():
    model = load(0.0)
    engine = model.engine
    engine.on_output, engine.should_yield = (lambda out: None), (lambda: True)
    with torch.inference_mode():
        engine.add(0, [5, 6, 7, 8], LONG, "long")
        engine.step()
        engine.prefill_seconds = 1e9
        engine.add(1, [9, 10, 11], SHORT, "late")
        engine.step()
        assert {r.request_id for r in engine.running} == {"long", "late"}


def test_the_prefill_step_time_is_measured(engine_with_clock):
    model, engine, clock, outputs = engine_with_clock
    assert engine.prefill_seconds == 0.0
    engine.add(0, [5, 6, 7, 8], SHORT, "a")
    engine.step()
    assert engine.prefill_seconds > 0.0


@pytest.mark.parametrize("factor", [-0.1, float("nan"), 1000.0])
def test_bad_factor_is_refused(factor):
    with pytest.raises(ValidationError, match="scheduler_delay_factor"):
        EngineConfig(scheduler_delay_factor=factor)
