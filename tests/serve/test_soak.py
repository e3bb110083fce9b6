"""Soak: NUM_REQUESTS requests through one server process, CONCURRENCY in flight, a seeded mix of completions and
chat, streamed and not, greedy and seeded sampling; some clients leave (a stream closed after its first chunk, a
non-streamed request whose client times out), a few requests are bad (4xx). Afterwards the engine is idle with
every KV page free, and a greedy request answers what it answered before the soak."""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Iterator

import openai
import pytest

from .clients import GREEDY, MODEL, scrape, wait_until
from .conftest import running_server

NUM_REQUESTS = 10_000
CONCURRENCY = 48  # requests in flight; the server batches 8 and queues the rest
WALL_CAP_S = 600  # the whole soak; past it the test fails instead of hanging
IDLE_WAIT_S = 30  # for the last aborts to leave the batch
LEFT_MAX_TOKENS = 2000  # requests whose clients leave ask for many: lost aborts stall the soak into its cap
CLIENT_TIMEOUT_S = 120  # any one request that should finish
SEED = 20240611
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\nclass ", "    for key, value in ", "def main():\n    ",
           "# utilities\nimport ", "class Stack:\n    def "]
PROBE = {"prompt": PROMPTS[0], "max_tokens": 16, **GREEDY}
NORMAL = {"stop", "length"}
BAD = [{"max_tokens": -3}, {"model": "gpt-4"}]  # 400 and 404
ALLOWED = {"normal": NORMAL, "cancel": {"cancelled"}, "timeout": NORMAL | {"timed out"}, "bad": {"4xx"}}


def _plan(rng: random.Random) -> tuple[str, dict]:
    """A request: (what the client does with it, its arguments)."""
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    sampling = GREEDY if rng.random() < 0.5 else {"temperature": 1.0, "seed": rng.randrange(2**31)}
    prompt = rng.choice(PROMPTS)
    kwargs = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    kwargs |= {"model": MODEL, "max_tokens": rng.randint(1, 4), "stream": stream, **sampling}
    roll = rng.random()
    if roll < 0.01:
        return "bad", kwargs | rng.choice(BAD)
    endless = {"max_tokens": LEFT_MAX_TOKENS, "extra_body": {"ignore_eos": True}}
    if stream and roll < 0.2:
        return "cancel", kwargs | endless
    if not stream and roll < 0.04:
        return "timeout", kwargs | endless | {"timeout": rng.uniform(0.001, 0.05)}
    return "normal", kwargs


async def _send(client: openai.AsyncOpenAI, action: str, kwargs: dict) -> str:
    """One request's outcome: its finish reason, "cancelled", "timed out", "4xx", or "got <what went wrong>"."""
    create = client.chat.completions.create if "messages" in kwargs else client.completions.create
    try:
        if not kwargs["stream"]:
            return str((await create(**kwargs)).choices[0].finish_reason)
        finish_reason = None
        async with await create(**kwargs) as stream:
            async for chunk in stream:
                if action == "cancel":
                    return "cancelled"  # leaving the block closes the stream after its first chunk
                finish_reason = chunk.choices[0].finish_reason or finish_reason
        return str(finish_reason)
    except openai.APITimeoutError:
        return "timed out" if action == "timeout" else "got APITimeoutError"
    except openai.APIStatusError as err:
        return "4xx" if action == "bad" and 400 <= err.status_code < 500 else f"got {err.status_code}"
    except openai.APIError as err:
        return f"got {type(err).__name__}"


async def _soak(url: str, plan: list[tuple[str, dict]], outcomes: list[str]) -> None:
    """Each planned request's outcome into ``outcomes`` (same order), CONCURRENCY requests in flight."""
    todo = iter(enumerate(plan))

    async def worker(client: openai.AsyncOpenAI) -> None:
        for i, (action, kwargs) in todo:  # one iterator shared by the workers: each request is sent once
            outcomes[i] = await _send(client, action, kwargs)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                  timeout=CLIENT_TIMEOUT_S) as client:
        await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))


def _run_soak(url: str, plan: list[tuple[str, dict]]) -> tuple[list[str], float]:
    """(the outcomes, seconds taken); fails the test past WALL_CAP_S."""
    outcomes = [""] * len(plan)
    start = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(_soak(url, plan, outcomes), WALL_CAP_S))
    except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
        pytest.fail(f"the soak passed its {WALL_CAP_S} s cap with {sum(map(bool, outcomes))} of {len(plan)} requests "
                    f"answered; (running, waiting, free pages) = {_gauges(url)}", pytrace=False)
    return outcomes, time.monotonic() - start


def _gauges(url: str) -> tuple[float, float, float]:
    """(requests running, requests waiting, free KV pages)."""
    m = scrape(url)
    return m["tllm_spec_requests_running"], m["tllm_spec_requests_waiting"], m["tllm_spec_kv_free_pages"]


def _check_ledger(before: dict[str, float], after: dict[str, float], counts: Counter, summary: str) -> None:
    """The server counted each answer once as stop/length and no engine error, and aborted requests whose clients
    left (at most one abort each: a client that timed out before sending left nothing to abort)."""
    def delta(reason: str) -> float:
        key = f'tllm_spec_requests_total{{finish_reason="{reason}"}}'
        return after.get(key, 0) - before.get(key, 0)
    num_answered = sum(n for outcome, n in counts.items() if outcome.split(": ")[1] in NORMAL)
    num_left = counts["cancel: cancelled"] + counts["timeout: timed out"]
    finished = {reason: delta(reason) for reason in ("stop", "length", "abort", "error")}
    assert (finished["error"], finished["stop"] + finished["length"]) == (0, num_answered), f"{finished}; {summary}"
    assert 0 < finished["abort"] <= num_left, f"{finished}; {summary}"


@pytest.fixture(scope="module")
def soak_server_url() -> Iterator[str]:
    """A server of its own, so that the soak's load and any damage stay out of the other tests."""
    with running_server() as url:
        yield url


@pytest.mark.slow
def test_soak_with_cancellations_ends_idle_with_every_page_free(soak_server_url):
    url = soak_server_url
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S) as client:
        probe = client.completions.create(model=MODEL, **PROBE).choices[0].text
        before = scrape(url)
        rng = random.Random(SEED)
        plan = [_plan(rng) for _ in range(NUM_REQUESTS)]
        outcomes, elapsed = _run_soak(url, plan)
        counts = Counter(f"{action}: {outcome}" for (action, _), outcome in zip(plan, outcomes))
        summary = f"{NUM_REQUESTS} requests in {elapsed:.0f} s ({NUM_REQUESTS / elapsed:.0f}/s): {dict(counts)}"
        assert all(outcome in ALLOWED[action] for (action, _), outcome in zip(plan, outcomes)), summary
        idle = (0, 0, before["tllm_spec_kv_free_pages"])
        assert wait_until(lambda: _gauges(url) == idle, IDLE_WAIT_S), \
            f"(running, waiting, free pages) = {_gauges(url)} {IDLE_WAIT_S} s after the soak, not {idle}; {summary}"
        _check_ledger(before, scrape(url), counts, summary)
        assert client.completions.create(model=MODEL, **PROBE).choices[0].text == probe, summary
