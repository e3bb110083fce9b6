"""Prefix caching through the real server and the official openai client (conftest's session server runs with
--enable-prefix-caching): usage's prompt_tokens_details.cached_tokens, the prefix-cache counters and KV page gauges
of /metrics, POST /reset_prefix_cache, vLLM's cache_salt (its validation: test_fields.py), and
--no-enable-prefix-caching."""
from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from .clients import GREEDY, MODEL, Result, chat, complete, scrape, wait_until
from .conftest import running_server

PAGE_SIZE = 16  # EngineConfig.page_size: only whole prompt pages are cached
BODY = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" * 2
MAX_TOKENS = 12
IDLE_WAIT_S = 10.0


def _prompt() -> str:
    """A long prompt no other request sent: its first page, and so every later page's chained key, is its own."""
    return f"# {uuid.uuid4().hex}\n{BODY}"


def _send(client: openai.OpenAI, endpoint: str, prompt: str, stream: bool = False, **kwargs) -> Result:
    if endpoint == "chat":
        return chat(client, [{"role": "user", "content": prompt}], stream, max_tokens=MAX_TOKENS, **GREEDY, **kwargs)
    return complete(client, prompt, stream, max_tokens=MAX_TOKENS, **GREEDY, **kwargs)


def _cached(usage: openai.types.CompletionUsage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def _cacheable(usage: openai.types.CompletionUsage) -> int:
    """What a repeat of the prompt reuses: the whole pages before its last token, which is computed again (its
    logits; the demo's EAGLE-3 head reads one token ahead, so no page past it is keyed either)."""
    return (usage.prompt_tokens - 1) // PAGE_SIZE * PAGE_SIZE


def _idle_metrics(url: str) -> dict[str, float]:
    """/metrics once no request runs and no page is held (a finished request's pages return at the step's end)."""
    assert wait_until(lambda: scrape(url)["tllm_spec_kv_used_pages"] == 0, IDLE_WAIT_S), scrape(url)
    return scrape(url)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_repeated_prompt_reports_its_cached_pages_and_the_same_greedy_text(client, endpoint):
    prompt = _prompt()
    miss = _send(client, endpoint, prompt)
    hits = [_send(client, endpoint, prompt, stream=True), _send(client, endpoint, prompt)]  # usage chunk, body
    assert _cached(miss.usage) == 0
    for hit in hits:
        assert _cached(hit.usage) == _cacheable(hit.usage) > 0 and _cached(hit.usage) % PAGE_SIZE == 0
        assert (hit.text, hit.finish_reason, hit.usage.completion_tokens) == \
            (miss.text, miss.finish_reason, miss.usage.completion_tokens)
        assert hit.usage.prompt_tokens == miss.usage.prompt_tokens  # cached tokens are part of the prompt's count


def test_continuous_usage_carries_the_cached_tokens_in_every_chunk(client):
    prompt = _prompt()
    _send(client, "completions", prompt)
    usages = [chunk.usage for chunk in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=True, **GREEDY,
        stream_options={"include_usage": True, "continuous_usage_stats": True})]
    assert len(usages) > 2 and all(usage is not None for usage in usages)
    expected = _cacheable(usages[-1])
    assert expected > 0 and all(_cached(u) == expected for u in usages)


def test_metrics_count_the_looked_up_and_cached_tokens_and_the_page_gauges_add_up(client, server_url):
    prompt = _prompt()
    before = _idle_metrics(server_url)
    miss = _send(client, "completions", prompt)
    middle = _idle_metrics(server_url)
    hit = _send(client, "completions", prompt, stream=True)
    after = _idle_metrics(server_url)
    for start, end, result in ((before, middle, miss), (middle, after, hit)):
        assert end["tllm_spec_prefix_cache_queries_total"] - start["tllm_spec_prefix_cache_queries_total"] == \
            result.usage.prompt_tokens
        assert end["tllm_spec_prefix_cache_hits_total"] - start["tllm_spec_prefix_cache_hits_total"] == \
            _cached(result.usage)
    assert _cached(hit.usage) > 0
    for m in (before, middle, after):
        assert m["tllm_spec_kv_free_pages"] + m["tllm_spec_kv_used_pages"] == m["tllm_spec_kv_pages"] - 1  # scratch
    for m in (middle, after):  # the prompt's pages stay cached, evictable (and allocatable: counted as free)
        assert m["tllm_spec_kv_free_pages"] >= m["tllm_spec_kv_evictable_pages"] >= _cached(hit.usage) // PAGE_SIZE


def test_reset_prefix_cache_makes_the_next_request_prefill_from_its_first_token(client, server_url):
    prompt = _prompt()
    first = _send(client, "chat", prompt)
    assert _cached(_send(client, "chat", prompt).usage) > 0
    response = httpx.post(f"{server_url}/reset_prefix_cache", timeout=30)
    assert response.status_code == 200 and response.json() == {"status": "ok", "prefix_caching": True}
    metrics = _idle_metrics(server_url)
    assert metrics["tllm_spec_kv_evictable_pages"] == 0
    assert metrics["tllm_spec_kv_free_pages"] == metrics["tllm_spec_kv_pages"] - 1
    again = _send(client, "chat", prompt)
    assert _cached(again.usage) == 0 and again.text == first.text


def test_requests_share_cached_pages_only_with_the_same_cache_salt(client):
    prompt = _prompt()
    first = _send(client, "completions", prompt, extra_body={"cache_salt": "tenant-a"})
    other_tenant = _send(client, "completions", prompt, extra_body={"cache_salt": "tenant-b"})
    unsalted = _send(client, "completions", prompt)
    same_tenant = _send(client, "completions", prompt, stream=True, extra_body={"cache_salt": "tenant-a"})
    assert _cached(first.usage) == _cached(other_tenant.usage) == _cached(unsalted.usage) == 0
    assert _cached(same_tenant.usage) == _cacheable(same_tenant.usage) > 0
    assert other_tenant.text == unsalted.text == same_tenant.text == first.text


@pytest.mark.slow  # starts a server of its own: fifteen seconds or more on the 2-core machine
def test_no_enable_prefix_caching_reports_zero_cached_tokens_always():
    prompt = _prompt()
    with running_server("--no-enable-prefix-caching") as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120) as client:
        results = [_send(client, endpoint, prompt, stream) for endpoint in ("completions", "chat")
                   for stream in (False, True, False)]
        assert all(_cached(result.usage) == 0 for result in results)
        metrics = scrape(url)
        assert (metrics["tllm_spec_prefix_cache_queries_total"], metrics["tllm_spec_prefix_cache_hits_total"]) == (0, 0)
        assert httpx.post(f"{url}/reset_prefix_cache", timeout=30).json() == {"status": "ok", "prefix_caching": False}
