"""Logprobs through the official openai client: completions' ``logprobs: N`` and chat's ``logprobs`` /
``top_logprobs`` in OpenAI's shapes, equal to the offline engine's, streamed chunks adding up to the whole."""
from __future__ import annotations

import pytest

from tllm_spec import SamplingParams

from .clients import MODEL

PROMPT = "def fibonacci(n):\n"
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
CHAT_PROMPT = "<|system|>\nYou write Python.\n<|user|>\ndef add(a, b):\n<|assistant|>\n"  # the documented template
TOL = 1e-4


def offline_logprobs(offline, prompt: str, num_top: int, max_new_tokens: int):
    """(the output, its tokens' texts, the texts of each position's top entries) from the engine in this process."""
    out = offline.generate([prompt], SamplingParams(max_new_tokens=max_new_tokens, logprobs=num_top,
                                                    ignore_eos=True))[0]
    text = offline.tokenizer.decode
    return out, [text([t]) for t in out.token_ids], [[text([t]) for t in top] for top in out.top_logprobs]


def test_completion_logprobs_equal_offline_and_streamed_chunks_add_up(client, offline):
    out, texts, top_texts = offline_logprobs(offline, PROMPT, 3, 24)
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 3,
              "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kwargs).choices[0]
    logprobs = whole.logprobs
    assert logprobs.tokens == texts and "".join(texts) == whole.text
    assert logprobs.token_logprobs == pytest.approx(out.logprobs, abs=TOL)
    assert logprobs.text_offset == [len("".join(texts[:i])) for i in range(len(texts))]
    for top, token, value, expected_top in zip(logprobs.top_logprobs, texts, logprobs.token_logprobs, top_texts):
        assert set(expected_top) <= set(top) and set(top) <= set(expected_top) | {token}  # top 3 and the token
        assert top[token] == value
    chunks = [c.choices[0].logprobs for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert len(chunks) > 1
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for chunk in chunks for x in getattr(chunk, field)] == getattr(logprobs, field), field


def test_chat_logprobs_equal_offline_and_streamed_chunks_add_up(client, offline):
    out, texts, top_texts = offline_logprobs(offline, CHAT_PROMPT, 2, 16)
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 0, "logprobs": True,
              "top_logprobs": 2, "extra_body": {"ignore_eos": True}}
    content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert [c.token for c in content] == texts
    assert [c.logprob for c in content] == pytest.approx(out.logprobs, abs=TOL)
    for entry, expected_top, expected_values in zip(content, top_texts, out.top_logprobs):
        assert entry.bytes == list(entry.token.encode())
        assert [t.token for t in entry.top_logprobs] == expected_top
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(list(expected_values.values()), abs=TOL)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the token is the most likely one
    streamed = [entry for c in client.chat.completions.create(**kwargs, stream=True)
                if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    # prefix caching: a request that finds its prompt's first pages cached (the second here, at least) computes the
    # rest as a chunk from a page boundary, whose logprobs agree with a whole prefill's to float rounding only
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=TOL)


def test_chat_logprobs_without_top_logprobs_and_none_when_not_asked(client):
    asked = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True)
    content = asked.choices[0].logprobs.content
    assert len(content) == asked.usage.completion_tokens and all(e.top_logprobs == [] for e in content)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).choices[0].logprobs is None
