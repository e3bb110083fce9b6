"""Many clients at once: 32 concurrent streams each equal to its own non-streamed result and to offline
decoding; clients that leave mid-stream abort their requests (the engine's batch empties, its KV pages return)."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tllm_spec import SamplingParams

from .clients import GREEDY, MODEL, chat, complete, scrape, wait_until

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\nclass ", "    for key, value in ", "def main():\n    ",
           "# utilities\nimport ", "class Stack:\n    def "]
NUM_CLIENTS = 32
ABORT_WAIT_S = 5.0  # an aborted request leaves the batch at the next step; four 2000-token ones take ~13 s on CPU
LONG = {"max_tokens": 2000, "extra_body": {"ignore_eos": True}, **GREEDY}


def _request(i: int) -> dict:
    """Client i's request: greedy or seeded sampling (its own seed), 12..27 tokens."""
    sampling = GREEDY if i % 2 == 0 else {"temperature": 1.0, "seed": 100 + i}
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 12 + i % 16, **sampling}


async def _stream_text(client: openai.AsyncOpenAI, request: dict) -> str:
    stream = await client.completions.create(model=MODEL, stream=True, **request)
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


async def _whole_text(client: openai.AsyncOpenAI, request: dict) -> str:
    return (await client.completions.create(model=MODEL, **request)).choices[0].text


async def _run_all(base_url: str, requests: list[dict]) -> tuple[list[str], list[str]]:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        streamed = await asyncio.gather(*(_stream_text(c, r) for r in requests))
        whole = await asyncio.gather(*(_whole_text(c, r) for r in requests))
    return streamed, whole


@pytest.mark.slow  # 32 streams through the real server: ten seconds on the 2-core machine
def test_32_concurrent_streams_each_equal_its_non_streamed_result_and_offline(server_url, offline):
    requests = [_request(i) for i in range(NUM_CLIENTS)]
    streamed, whole = asyncio.run(_run_all(server_url, requests))
    params = [SamplingParams(max_new_tokens=r["max_tokens"], temperature=r["temperature"], seed=r.get("seed"))
              for r in requests]
    expected = [o.text for o in offline.generate([r["prompt"] for r in requests], params)]
    assert streamed == whole == expected
    assert len(set(streamed)) > len(PROMPTS)  # the seeded requests did sample


def _idle(url: str, free_pages: float) -> bool:
    m = scrape(url)
    return (m["tllm_spec_requests_running"], m["tllm_spec_requests_waiting"], m["tllm_spec_kv_free_pages"]) == \
        (0, 0, free_pages)


def test_closing_streams_aborts_their_requests_and_frees_their_pages(client, server_url):
    before = scrape(server_url)
    streams = [client.completions.create(model=MODEL, prompt=PROMPTS[i % 3], stream=True,
                                         **(LONG if i % 2 else {"max_tokens": 16, **GREEDY})) for i in range(8)]
    firsts = [next(iter(stream)) for stream in streams]
    assert all(first.choices and first.choices[0].finish_reason is None for first in firsts)
    for stream in streams[1::2]:
        stream.close()  # the long ones: their clients leave after the first chunk
    for stream in streams[0::2]:
        assert [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason] == ["length"]
    assert wait_until(lambda: _idle(server_url, before["tllm_spec_kv_free_pages"]), ABORT_WAIT_S), scrape(server_url)
    after = scrape(server_url)
    aborted = 'tllm_spec_requests_total{finish_reason="abort"}'
    assert after[aborted] - before.get(aborted, 0) == 4
    assert complete(client, PROMPTS[0], stream=False, max_tokens=8, **GREEDY).finish_reason == "length"


def test_a_chat_stream_closed_early_is_aborted_too(client, server_url):
    before = scrape(server_url)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                                            **LONG)
    next(iter(stream))
    stream.close()
    assert wait_until(lambda: _idle(server_url, before["tllm_spec_kv_free_pages"]), ABORT_WAIT_S), scrape(server_url)
    assert chat(client, [{"role": "user", "content": "hi"}], stream=False, max_tokens=4, **GREEDY).text


def test_clients_that_leave_non_streamed_requests_abort_them(server_url):
    before = scrape(server_url)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000, "ignore_eos": True, "temperature": 0}

    def leave_after_a_second(_) -> type:
        try:
            return type(httpx.post(f"{server_url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.0)))
        except httpx.ReadTimeout as err:  # the client gives up and closes its connection
            return type(err)
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(leave_after_a_second, range(4))) == [httpx.ReadTimeout] * 4
    assert wait_until(lambda: _idle(server_url, before["tllm_spec_kv_free_pages"]), ABORT_WAIT_S), scrape(server_url)
