"""Prefix caching under faults: a request aborted while the prompt that reuses cached pages is prefilled in chunks
(the reuser, one of two reusers, the request that wrote the pages), a step that raises KeyboardInterrupt, Ctrl-C
in generate, an exception while a prefix hit is admitted, a cache reset. Afterwards the pool is whole, recounted
page by page (each page free or evictable, none held, none freed twice; cached = evictable), every slot is free,
and the prefix hits again with the cache-off output."""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tllm_spec import Eagle3Config, SamplingParams
from tllm_spec.engine.engine import Engine
from tllm_spec.engine.request import Request, StreamOutput
from tllm_spec.engine.runner import ModelRunner
from tllm_spec.spec_model import SpecModel

from ..models import tiny_pair

PAGE, BUDGET, MAX_BATCH = 4, 6, 3  # 4-token pages; 6 prompt tokens a step: a prompt enters over several steps
PREFIX = [(7 * i + 3) % 97 for i in range(24)]  # 6 pages
# prefilled first: PREFIX's 6 pages are cached, the last keyed with token 90 after it (the EAGLE-3 head's K/V at
# position p reads token p + 1)
WRITER = PREFIX + [90]
REUSERS = [WRITER + list(range(40, 53)), WRITER + list(range(60, 70))]  # 24 cached + 14 / 11 tokens in chunks
PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)


def load(cache: bool) -> SpecModel:
    """Admission at once (no window, no delay): the tests drive the engine step by step."""
    target, head = tiny_pair("llama")
    return SpecModel.from_pretrained(target, Eagle3Config(speculative_model=str(head), max_draft_len=3),
                                     max_batch_size=MAX_BATCH, page_size=PAGE, max_num_batched_tokens=BUDGET,
                                     admission_window_ms=0.0, scheduler_delay_factor=0.0,
                                     enable_prefix_caching=cache)


@pytest.fixture(scope="module")
def expected() -> dict[tuple[int, ...], tuple[list[int], list[int]]]:
    """Each prompt's greedy tokens and tokens accepted per step with the cache off (a stale draft K/V over a
    reused prefix changes the drafts, so the acceptance, and not the tokens)."""
    prompts = [WRITER, *REUSERS]
    outs = load(cache=False).generate(prompts, PARAMS)
    return {tuple(p): seen(o) for p, o in zip(prompts, outs)}


def seen(out) -> tuple[list[int], list[int]]:
    """What a request's output shows of the cache: nothing but its stats' cached_prompt_tokens."""
    return out.token_ids, out.stats.accepted_per_step


@pytest.fixture
def model() -> Iterator[SpecModel]:
    model = load(cache=True)
    yield model
    model.close()


@contextmanager
def driven(engine: Engine) -> Iterator[list[StreamOutput]]:
    """Drive the engine from this thread (its loop's thread not started): its outputs, collected. The loop's
    delivery is put back afterwards, so that ``generate`` works on the same engine."""
    outputs: list[StreamOutput] = []
    deliver, engine.on_output = engine.on_output, outputs.append
    try:
        yield outputs
    finally:
        engine.on_output = deliver


def run_to_end(engine: Engine, prompt: list[int], request_id: str) -> None:
    engine.add(0, prompt, PARAMS, request_id)
    while engine.num_requests:
        engine.step()


def assert_pool_whole(model: SpecModel) -> None:
    """Idle: every page free or evictable, recounted from the pool's own lists (a page released twice would be
    listed twice, a leaked hold leaves a page out), every cached page evictable, every slot free."""
    kv = model.runner.kv_cache
    pool = kv.pages
    assert pool.num_in_use == 0 and pool.num_available == pool.total, (pool.num_in_use, pool.num_available)
    assert sorted([*pool._free, *pool._evictable]) == list(range(1, pool.total + 1))
    assert not any(pool._refs) and pool.num_evictable == pool.num_cached
    assert kv.num_free_slots == MAX_BATCH


def assert_hits_with_cache_off_output(model: SpecModel, expected: dict, prompt: list[int], cached: int) -> None:
    """``prompt`` through ``generate`` (the loop's thread): the cache-off tokens, ``cached`` tokens reused."""
    out = model.generate([prompt], PARAMS)[0]
    assert seen(out) == expected[tuple(prompt)]
    assert out.stats.cached_prompt_tokens == cached
    model.loop.call(lambda: assert_pool_whole(model))


def warm(model: SpecModel) -> None:
    """Prefill WRITER to its end: PREFIX's pages are cached, no page is held."""
    run_to_end(model.engine, WRITER, "writer")
    assert model.runner.kv_cache.pages.num_cached >= len(PREFIX) // PAGE
    assert_pool_whole(model)


def reuser_in_prefill(engine: Engine, prompt: list[int], request_id: str) -> Request:
    """Add ``prompt`` and run one step: it shares PREFIX's pages and has prefilled one chunk past them."""
    engine.add(0, prompt, PARAMS, request_id)
    engine.step()
    request = next(r for r in engine.running if r.request_id == request_id)
    assert request.stats.cached_prompt_tokens == len(PREFIX) and request.is_context
    assert request.num_cached == len(PREFIX) + BUDGET
    return request


def test_aborting_the_reuser_mid_prefill_returns_its_pages(model, expected):
    engine = model.engine
    with driven(engine) as outputs:
        warm(model)
        reuser_in_prefill(engine, REUSERS[0], "reuser")
        assert engine.kv.pages.num_in_use > 0
        assert engine.abort("reuser")
        engine.step()
        assert_pool_whole(model)
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finished][-1] == ("reuser", "abort")
    # the aborted request's chunk (positions 24-29) was written in a completed step: its full page is cached too
    assert_hits_with_cache_off_output(model, expected, REUSERS[0], len(PREFIX) + PAGE)


@pytest.mark.slow  # the README command keeps the reuser's abort, interrupts and admission faults
def test_aborting_one_of_two_reusers_leaves_the_other_its_shared_pages(model, expected):
    engine = model.engine
    with driven(engine) as outputs:
        warm(model)
        engine.add(0, REUSERS[0], PARAMS, "kept")
        engine.add(0, REUSERS[1], PARAMS, "aborted")
        for _ in range(3):  # FIFO chunks of 6: "kept" 24-30, 30-36, 36-38 (then it decodes); "aborted" 24-28
            engine.step()
        kept, aborted = engine.running
        assert (kept.is_context, aborted.is_context, aborted.num_cached) == (False, True, len(PREFIX) + 4)
        assert engine.kv.pages_of(kept.slot)[:6] == engine.kv.pages_of(aborted.slot)[:6]  # each held twice
        assert engine.abort("aborted")
        while engine.num_requests:
            engine.step()
        assert_pool_whole(model)
    finished = {o.request_id: o for o in outputs if o.finished}
    assert finished["aborted"].finish_reason == "abort"
    assert seen(finished["kept"].output) == expected[tuple(REUSERS[0])]
    assert finished["kept"].output.stats.cached_prompt_tokens == len(PREFIX)
    assert_hits_with_cache_off_output(model, expected, REUSERS[1], len(PREFIX) + PAGE)  # + the page it wrote


def step_until(engine: Engine, done, max_steps: int = 50) -> None:
    for _ in range(max_steps):
        if done():
            return
        engine.step()
    assert done(), f"not done after {max_steps} steps"


@pytest.mark.slow  # the README command keeps the reuser's abort, interrupts and admission faults
def test_aborting_the_writer_leaves_its_published_pages_to_their_reuser(model, expected):
    """A prompt's pages are cached as its chunks complete: a request admitted meanwhile shares them, and keeps
    them when their writer is aborted mid-prefill."""
    engine = model.engine
    with driven(engine) as outputs:
        engine.add(0, REUSERS[0], PARAMS, "writer")
        for _ in range(3):  # 18 of its 38 tokens: pages 0-3 (positions 0-15) written and cached
            engine.step()
        assert engine.kv.pages.num_cached == 4
        engine.add(0, WRITER, PARAMS, "reuser")
        step_until(engine, lambda: any(r.request_id == "reuser" for r in engine.running))
        writer, reuser = engine.running
        assert reuser.stats.cached_prompt_tokens >= 4 * PAGE and reuser.is_context and writer.is_context
        num_written = writer.num_published * PAGE  # the pages its completed chunks wrote, all cached
        assert engine.abort("writer")
        step_until(engine, lambda: not engine.num_requests)
        assert_pool_whole(model)
    finished = {o.request_id: o for o in outputs if o.finished}
    assert finished["writer"].finish_reason == "abort"
    assert seen(finished["reuser"].output) == expected[tuple(WRITER)]
    assert_hits_with_cache_off_output(model, expected, REUSERS[0], num_written)


@pytest.mark.slow  # the README command keeps the reuser's abort, interrupts and admission faults
def test_aborting_the_writer_of_a_prefix_others_wait_for_lets_them_run(model, expected):
    """Two requests with one new prefix, admitted together (the second may wait for the first's pages): the first
    is aborted after its first chunk; the second runs to the cache-off output."""
    engine = model.engine
    with driven(engine) as outputs:
        engine.add(0, REUSERS[0], PARAMS, "writer")
        engine.add(0, REUSERS[1], PARAMS, "follower")
        engine.step()
        assert engine.abort("writer")
        step_until(engine, lambda: not engine.num_requests)
        assert_pool_whole(model)
    finished = {o.request_id: o for o in outputs if o.finished}
    assert finished["writer"].finish_reason == "abort"
    assert seen(finished["follower"].output) == expected[tuple(REUSERS[1])]


def test_a_keyboard_interrupt_in_a_reusing_chunk_returns_every_page(model, expected, monkeypatch):
    """The step that prefills past the reused pages raises KeyboardInterrupt (a request decoding beside it): both
    requests end with "error", every page comes back, and the prefix hits again."""
    engine, real_step = model.engine, ModelRunner.step
    calls: list[tuple[int, ...]] = []

    def interrupted(self, ids, positions, slots, drafts, params, context_lens, k, next_k=None, starts=(), *rest):
        calls.append(tuple(starts))
        if len(PREFIX) in starts:
            raise KeyboardInterrupt
        return real_step(self, ids, positions, slots, drafts, params, context_lens, k, next_k, starts, *rest)
    with driven(engine) as outputs:
        warm(model)
        engine.add(0, [5, 6, 7], PARAMS, "decoding")
        engine.step()
        monkeypatch.setattr(ModelRunner, "step", interrupted)
        engine.add(0, REUSERS[0], PARAMS, "reuser")
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        assert calls[-1] == (len(PREFIX),) and not engine.running
        assert_pool_whole(model)
    monkeypatch.setattr(ModelRunner, "step", real_step)
    assert {o.request_id: o.finish_reason for o in outputs if o.finished} == {"writer": "length",
                                                                              "decoding": "error",
                                                                              "reuser": "error"}
    assert_hits_with_cache_off_output(model, expected, REUSERS[0], len(PREFIX))


def test_ctrl_c_in_generate_during_a_reusing_prefill_returns_every_page(model, expected, monkeypatch,
                                                                         python_ctrl_c):
    """Ctrl-C reaches the caller of generate while the engine's thread runs the chunk past the reused pages (SIGINT
    sent from inside that step, which waits for the caller's aborts): the call's requests are aborted, their pages
    and holds come back."""
    real_step, real_abort = ModelRunner.step, model.loop.abort
    interrupted, aborted = threading.Event(), threading.Event()

    def step(self, ids, positions, slots, drafts, params, context_lens, k, next_k=None, starts=(), *rest):
        if len(PREFIX) in starts and not interrupted.is_set():
            interrupted.set()
            for _ in range(20):  # until the caller has taken it, while this step is in flight (a SIGINT that
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # lands just before the caller
                if aborted.wait(0.5):  # blocks in its queue's get is only seen at its next output)
                    break
        return real_step(self, ids, positions, slots, drafts, params, context_lens, k, next_k, starts, *rest)

    def abort(request_id: str) -> None:
        real_abort(request_id)
        aborted.set()
    model.generate([WRITER], PARAMS)
    monkeypatch.setattr(ModelRunner, "step", step)
    monkeypatch.setattr(model.loop, "abort", abort)
    with pytest.raises(KeyboardInterrupt):
        model.generate(REUSERS, PARAMS)
    assert interrupted.is_set() and aborted.is_set()
    monkeypatch.undo()
    model.loop.call(lambda: assert_pool_whole(model))
    # the second reuser was aborted before its first chunk: PREFIX's pages are all it finds
    assert_hits_with_cache_off_output(model, expected, REUSERS[1], len(PREFIX))


@pytest.mark.slow  # the README command keeps the reuser's abort, interrupts and admission faults
def test_reset_mid_prefill_keeps_the_held_pages_until_their_request_ends(model, expected):
    engine = model.engine
    with driven(engine) as outputs:
        warm(model)
        reuser_in_prefill(engine, REUSERS[0], "reuser")
        model.engine.prefix_cache.reset()
        assert engine.kv.pages.num_cached == 0 and engine.kv.pages.num_in_use > 0
        while engine.num_requests:
            engine.step()
        assert_pool_whole(model)
    assert seen(outputs[-1].output) == expected[tuple(REUSERS[0])]
    assert_hits_with_cache_off_output(model, expected, REUSERS[0], 0)  # the chain's first pages are gone


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_exception_while_a_prefix_hit_is_admitted_returns_every_page(model, monkeypatch, error):
    """A request admitted before the prefix hit whose admission raises, and the hit itself, end with "error" and
    hold nothing."""
    engine = model.engine

    def failing(slot: int, tokens: list[int]) -> None:
        raise error("injected")
    with driven(engine) as outputs:
        warm(model)
        monkeypatch.setattr(engine.prefix_cache.worker, "prefix_reused", failing)
        engine.add(0, [5, 6, 7], PARAMS, "admitted")
        engine.add(0, REUSERS[0], PARAMS, "reuser")
        with pytest.raises(error):
            engine.step()
        monkeypatch.undo()
        assert_pool_whole(model)
        assert {o.request_id: o.finish_reason for o in outputs if o.finished} == {"writer": "length",
                                                                                  "admitted": "error",
                                                                                  "reuser": "error"}
