"""Soak: NUM_REQUESTS requests through one server process, CONCURRENCY in flight, a seeded mix of completions and
chat, streamed and not, greedy and seeded sampling; some clients leave (a stream closed after its first chunk, a
non-streamed request whose client times out), a few requests are bad (4xx). Prefix caching is on over a pool of
NUM_PAGES pages, far fewer than the pages of the distinct prefixes sent: a share of the prompts start with one of
a few long shared prefixes (hits), a smaller share with one of many rare ones (misses that evict). Afterwards the
engine is idle with every KV page free or evictable (recounted page by page: tests/serve/pool_server.py), the
cache has hit and evicted (a canary prefix cached before the soak is gone), SPOT_CHECKS greedy completions sent
during the soak equal the offline engine's with the cache off, and a greedy request answers what it answered
before the soak."""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from tllm_spec import SamplingParams, SpecModel

from .clients import GREEDY, MODEL, scrape, wait_until
from .conftest import server_process
from .pool_server import ROUTE

NUM_REQUESTS = 10_000
CONCURRENCY = 48  # requests in flight; the server batches 8 and queues the rest
WALL_CAP_S = 600  # the whole soak; past it the test fails instead of hanging
IDLE_WAIT_S = 30  # for the last aborts to leave the batch
LEFT_MAX_TOKENS = 1800  # requests whose clients leave ask for many (lost aborts stall the soak into its cap);
# 248 positions of the demo's 2048 are left for a prompt with a prefix
CLIENT_TIMEOUT_S = 120  # any one request that should finish
SEED = 20240611
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\nclass ", "    for key, value in ", "def main():\n    ",
           "# utilities\nimport ", "class Stack:\n    def "]
PAGE_SIZE = 16  # EngineConfig's default
NUM_PAGES = 400  # the pool (one page scratch): three requests whose clients leave (~120 pages each) and a few more
PREFIX_BODY = "def add(a, b):\n    return a + b\n\n" * 5  # a prefix is ~75 tokens with its tag: 4 whole pages
SHARED_PREFIXES = [f"# system prompt {n}\n{PREFIX_BODY}" for n in range(4)]
NUM_RARE_PREFIXES = 1000  # "# note N": each sent rarely, together far more pages than the pool
SHARED_SHARE, RARE_SHARE = 0.25, 0.05  # of the requests
CANARY = f"# canary\n{PREFIX_BODY}def main():\n"  # cached before the soak, never sent during it
SPOT_CHECKS, SPOT_MAX_TOKENS = 50, 16  # greedy completions with a prefix, compared with the cache-off engine
PROBE = {"prompt": PROMPTS[0], "max_tokens": 16, **GREEDY}
NORMAL = {"stop", "length"}
BAD = [{"max_tokens": -3}, {"model": "gpt-4"}]  # 400 and 404
ALLOWED = {"normal": NORMAL, "cancel": {"cancelled"}, "timeout": NORMAL | {"timed out"}, "bad": {"4xx"},
           "spot": NORMAL}


def _prefix(rng: random.Random) -> str:
    roll = rng.random()
    if roll < SHARED_SHARE:
        return rng.choice(SHARED_PREFIXES)
    return f"# note {rng.randrange(NUM_RARE_PREFIXES)}\n{PREFIX_BODY}" if roll < SHARED_SHARE + RARE_SHARE else ""


def _spot(rng: random.Random) -> tuple[str, dict]:
    """A greedy completion with a prefix whose text is checked against the cache-off engine."""
    prefix = rng.choice(SHARED_PREFIXES) if rng.random() < 0.8 else f"# note {rng.randrange(NUM_RARE_PREFIXES)}\n" \
        f"{PREFIX_BODY}"
    return "spot", {"prompt": prefix + rng.choice(PROMPTS), "model": MODEL, "max_tokens": SPOT_MAX_TOKENS,
                    "stream": rng.random() < 0.5, **GREEDY}


def _plan(rng: random.Random) -> tuple[str, dict]:
    """A request: (what the client does with it, its arguments)."""
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    sampling = GREEDY if rng.random() < 0.5 else {"temperature": 1.0, "seed": rng.randrange(2**31)}
    prompt = _prefix(rng) + rng.choice(PROMPTS)
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


def _text(choice) -> str:
    return (choice.message.content if hasattr(choice, "message") else
            choice.delta.content if hasattr(choice, "delta") else choice.text) or ""


async def _send(client: openai.AsyncOpenAI, action: str, kwargs: dict) -> tuple[str, str]:
    """One request's outcome (its finish reason, "cancelled", "timed out", "4xx", or "got <what went wrong>") and
    the text it got."""
    create = client.chat.completions.create if "messages" in kwargs else client.completions.create
    try:
        if not kwargs["stream"]:
            choice = (await create(**kwargs)).choices[0]
            return str(choice.finish_reason), _text(choice)
        finish_reason, text = None, ""
        async with await create(**kwargs) as stream:
            async for chunk in stream:
                if action == "cancel":
                    return "cancelled", text  # leaving the block closes the stream after its first chunk
                finish_reason = chunk.choices[0].finish_reason or finish_reason
                text += _text(chunk.choices[0])
        return str(finish_reason), text
    except openai.APITimeoutError:
        return ("timed out" if action == "timeout" else "got APITimeoutError"), ""
    except openai.APIStatusError as err:
        return ("4xx" if action == "bad" and 400 <= err.status_code < 500 else f"got {err.status_code}"), ""
    except openai.APIError as err:
        return f"got {type(err).__name__}", ""


async def _soak(url: str, plan: list[tuple[str, dict]], outcomes: list[str], texts: dict[int, str]) -> None:
    """Each planned request's outcome into ``outcomes`` (same order) and each spot check's text into ``texts``,
    CONCURRENCY requests in flight."""
    todo = iter(enumerate(plan))

    async def worker(client: openai.AsyncOpenAI) -> None:
        for i, (action, kwargs) in todo:  # one iterator shared by the workers: each request is sent once
            outcomes[i], text = await _send(client, action, kwargs)
            if action == "spot":
                texts[i] = text
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                  timeout=CLIENT_TIMEOUT_S) as client:
        await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))


def _run_soak(url: str, plan: list[tuple[str, dict]]) -> tuple[list[str], dict[int, str], float]:
    """(the outcomes, the spot checks' texts, seconds taken); fails the test past WALL_CAP_S."""
    outcomes, texts = [""] * len(plan), {}
    start = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(_soak(url, plan, outcomes, texts), WALL_CAP_S))
    except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
        pytest.fail(f"the soak passed its {WALL_CAP_S} s cap with {sum(map(bool, outcomes))} of {len(plan)} requests "
                    f"answered; (running, waiting, free pages) = {_gauges(url)}", pytrace=False)
    return outcomes, texts, time.monotonic() - start


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


def _plan_soak(rng: random.Random) -> list[tuple[str, dict]]:
    plan = [_plan(rng) for _ in range(NUM_REQUESTS)]
    for i in rng.sample(range(NUM_REQUESTS), SPOT_CHECKS):
        plan[i] = _spot(rng)
    return plan


def _num_distinct_prefixes(plan: list[tuple[str, dict]]) -> int:
    """The distinct (prefix, endpoint) pairs the plan sends: each fills 4 whole pages of its own (a chat template
    before the prefix shifts its pages)."""
    def first_line(kwargs: dict) -> str:
        return (kwargs.get("prompt") or kwargs["messages"][0]["content"]).split("\n", 1)[0]
    return len({(first_line(kwargs), "prompt" in kwargs) for _, kwargs in plan
                if first_line(kwargs).startswith(("# note ", "# system prompt "))})


def _pool(url: str) -> dict:
    return httpx.get(f"{url}{ROUTE}", timeout=30).raise_for_status().json()


def _hits_of(client: openai.OpenAI, url: str, prompt: str) -> int:
    """Prompt tokens a lone greedy completion of ``prompt`` found cached (the server otherwise idle)."""
    before = _pool(url)["hits"]
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY)
    return _pool(url)["hits"] - before


@contextmanager
def _pool_server(fields: dict) -> Iterator[str]:
    """A server (tests/serve/pool_server.py) with these EngineConfig fields; its base URL once it answers /health."""
    with server_process(launcher=("tests.serve.pool_server", json.dumps(fields))) as (_, url, _):
        yield url


@pytest.fixture(scope="module")
def soak_server_url() -> Iterator[str]:
    """A server of its own, so that the soak's load and any damage stay out of the other tests."""
    with _pool_server({"enable_prefix_caching": True, "num_pages": NUM_PAGES}) as url:
        yield url


def _check_spots(offline: SpecModel, plan: list[tuple[str, dict]], texts: dict[int, str], summary: str) -> None:
    """The spot checks' texts equal the offline engine's (prefix caching off on the CPU)."""
    spots = sorted(texts)
    assert len(spots) == SPOT_CHECKS, summary
    outs = offline.generate([plan[i][1]["prompt"] for i in spots], SamplingParams(max_new_tokens=SPOT_MAX_TOKENS,
                                                                                   temperature=0.0))
    mismatched = [i for i, out in zip(spots, outs) if texts[i] != out.text]
    assert not mismatched, f"{len(mismatched)} spot checks differ from the cache-off engine, e.g. " \
        f"{plan[mismatched[0]][1]!r}: {texts[mismatched[0]]!r}; {summary}"


@pytest.mark.slow
def test_soak_with_cancellations_and_prefix_caching_ends_idle_with_every_page_free(soak_server_url, offline):
    url = soak_server_url
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S) as client:
        probe = client.completions.create(model=MODEL, **PROBE).choices[0].text
        assert _hits_of(client, url, CANARY) == 0 and _hits_of(client, url, CANARY) > 0  # cached
        before, pool_before = scrape(url), _pool(url)
        assert pool_before["total"] == NUM_PAGES - 1 and pool_before["whole"]
        rng = random.Random(SEED)
        plan = _plan_soak(rng)
        assert 4 * _num_distinct_prefixes(plan) > 2 * NUM_PAGES  # they cannot all stay cached
        outcomes, texts, elapsed = _run_soak(url, plan)
        counts = Counter(f"{action}: {outcome}" for (action, _), outcome in zip(plan, outcomes))
        summary = f"{NUM_REQUESTS} requests in {elapsed:.0f} s ({NUM_REQUESTS / elapsed:.0f}/s): {dict(counts)}"
        assert all(outcome in ALLOWED[action] for (action, _), outcome in zip(plan, outcomes)), summary
        idle = (0, 0, before["tllm_spec_kv_free_pages"])  # free counts evictable pages: nothing held
        assert wait_until(lambda: _gauges(url) == idle, IDLE_WAIT_S), \
            f"(running, waiting, free pages) = {_gauges(url)} {IDLE_WAIT_S} s after the soak, not {idle}; {summary}"
        _check_ledger(before, scrape(url), counts, summary)
        pool = _pool(url)
        summary += f"; pool {pool}"
        assert pool["whole"] and (pool["in_use"], pool["available"], pool["free_slots"]) == (0, pool["total"], 8), \
            summary
        assert pool["evictable"] == pool["cached"] > 0, summary
        assert pool["hits"] > pool_before["hits"] and pool["evictions"] > 0, summary
        assert _hits_of(client, url, CANARY) == 0, summary  # evicted by the soak's prefixes
        _check_spots(offline, plan, texts, summary)
        assert client.completions.create(model=MODEL, **PROBE).choices[0].text == probe, summary
