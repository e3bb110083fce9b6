"""What the serve tests share: one request through the official openai client (streamed or not, reduced to text,
finish reason and usage), the offline oracle, and /metrics scraping."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tllm_spec import SamplingParams, SpecModel

API_KEY = "test-key"
MODEL = "tllm-spec-demo"
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 1.0, "seed": 1234}


@dataclass
class Result:
    text: str
    finish_reason: str | None
    usage: openai.types.CompletionUsage | None = None
    num_chunks: int = 0


def complete(client: openai.OpenAI, prompt: str | list[int], stream: bool, **kwargs) -> Result:
    """POST /v1/completions; a stream's text deltas concatenated, its finish reason and its usage chunk."""
    if not stream:
        response = client.completions.create(model=MODEL, prompt=prompt, **kwargs)
        return Result(response.choices[0].text, response.choices[0].finish_reason, response.usage)
    result = Result("", None)
    for chunk in client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                           stream_options={"include_usage": True}, **kwargs):
        _take(result, chunk, lambda choice: choice.text)
    return result


def chat(client: openai.OpenAI, messages: list[dict[str, str]], stream: bool, **kwargs) -> Result:
    """POST /v1/chat/completions, reduced like ``complete``."""
    if not stream:
        response = client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
        choice = response.choices[0]
        assert choice.message.role == "assistant"
        return Result(choice.message.content, choice.finish_reason, response.usage)
    result = Result("", None)
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **kwargs):
        assert not chunk.choices or (chunk.choices[0].delta.role == "assistant") == (result.num_chunks == 0)
        _take(result, chunk, lambda choice: choice.delta.content)
    return result


def _take(result: Result, chunk, text_of: Callable) -> None:
    """Fold one chunk into ``result``: nothing may follow the chunk with the finish reason but the usage chunk."""
    if chunk.usage is not None:
        assert not chunk.choices and result.finish_reason is not None and result.usage is None
        result.usage = chunk.usage
        return
    assert result.finish_reason is None, "a content chunk after the one with finish_reason"
    result.text += text_of(chunk.choices[0]) or ""
    result.finish_reason = chunk.choices[0].finish_reason
    result.num_chunks += 1


def offline_text(model: SpecModel, prompt: str | list[int], **params) -> str:
    return model.generate([prompt], SamplingParams(**params))[0].text


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """/metrics as {sample name with its labels: value}, e.g. 'tllm_spec_requests_total{finish_reason="stop"}'."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).raise_for_status().text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()
