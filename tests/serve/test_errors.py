"""Bad requests answer 4xx with OpenAI's error body and leave the server serving the same text; the API key and
the in-flight limit (429)."""
from __future__ import annotations

import httpx
import openai
import pytest

from .clients import API_KEY, GREEDY, MODEL, complete, scrape, wait_until

PROMPT = "def fibonacci(n):\n"
CHAT = [{"role": "user", "content": "hi"}]
BAD_COMPLETIONS = {  # body -> (status, the request field the error names)
    "max_tokens is not an integer": ({"prompt": PROMPT, "max_tokens": "ten"}, 400, "max_tokens"),
    "negative max_tokens": ({"prompt": PROMPT, "max_tokens": -3}, 400, "max_tokens"),
    "temperature above 100": ({"prompt": PROMPT, "temperature": 200}, 400, "temperature"),
    "prompt is a number": ({"prompt": 3}, 400, "prompt"),
    "no prompt": ({"max_tokens": 4}, 400, "prompt"),
    "two prompts": ({"prompt": ["a", "b"]}, 400, "prompt"),
    "token ids past the vocabulary": ({"prompt": [5, 10**6]}, 400, "prompt"),
    "token ids past max_seq_len": ({"prompt": [7] * 2100}, 400, "prompt"),
    "a huge string": ({"prompt": "lorem ipsum " * 3000}, 400, "prompt"),
    "logprobs above 20": ({"prompt": PROMPT, "logprobs": 21}, 400, "logprobs"),
    "echo": ({"prompt": PROMPT, "echo": True}, 400, "echo"),
    "n > 1": ({"prompt": PROMPT, "n": 2}, 400, "n"),
    "min_tokens": ({"prompt": PROMPT, "min_tokens": 3}, 400, "min_tokens"),
    "a stop token past the vocabulary": ({"prompt": PROMPT, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    "top_k below -1": ({"prompt": PROMPT, "top_k": -5}, 400, "top_k"),
    "unknown model": ({"prompt": PROMPT, "model": "gpt-4"}, 404, "model"),
}


def _check_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_bad_requests_answer_openai_errors_and_the_server_goes_on(server_url, client):
    before = complete(client, PROMPT, stream=False, max_tokens=16, **GREEDY).text
    for body, status, param in BAD_COMPLETIONS.values():
        for stream in (False, True):
            response = httpx.post(f"{server_url}/v1/completions", json={"model": MODEL, **body, "stream": stream},
                                  timeout=60)
            _check_error(response, status, param)
    _check_error(httpx.post(f"{server_url}/v1/completions", content=b'{"prompt": "x", ', timeout=10,
                            headers={"content-type": "application/json"}), 400)
    _check_error(httpx.post(f"{server_url}/v1/chat/completions", json={"messages": "hi"}, timeout=10), 400, "messages")
    for body in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):  # without logprobs; above 20
        _check_error(httpx.post(f"{server_url}/v1/chat/completions", timeout=10, json={"messages": CHAT, **body}),
                     400, "top_logprobs")
    assert complete(client, PROMPT, stream=False, max_tokens=16, **GREEDY).text == before
    assert complete(client, PROMPT, stream=True, max_tokens=16, **GREEDY).text == before
    assert scrape(server_url)["tllm_spec_requests_running"] == 0


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="cannot fit"):
        client.completions.create(model=MODEL, prompt=[7] * 2100, stream=True)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=0)


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list()] == [MODEL]


@pytest.mark.slow  # ten seconds or more on the 2-core CI machine: the second CI command runs it
def test_an_api_key_is_required_everywhere_but_health(keyed_server_url):
    url = keyed_server_url
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    for path in ("/v1/models", "/metrics"):
        _check_error(httpx.get(f"{url}{path}", timeout=10), 401)
        _check_error(httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"}, timeout=10), 401)
    _check_error(httpx.post(f"{url}/v1/completions", content=b"{bad json", timeout=10), 401)
    _check_error(httpx.post(f"{url}/reset_prefix_cache", timeout=10), 401)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as stranger, \
            pytest.raises(openai.AuthenticationError):
        stranger.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    with openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as owner:
        assert complete(owner, PROMPT, stream=False, max_tokens=4, **GREEDY).usage.completion_tokens == 4
    assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).status_code == 200


@pytest.mark.slow  # ten seconds or more on the 2-core CI machine: the second CI command runs it
def test_requests_past_the_in_flight_limit_get_429(keyed_server_url):
    with openai.OpenAI(base_url=f"{keyed_server_url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        stream = c.completions.create(model=MODEL, prompt=PROMPT, stream=True, max_tokens=2000,
                                      extra_body={"ignore_eos": True}, **GREEDY)  # the server admits one at a time
        next(iter(stream))
        with pytest.raises(openai.RateLimitError):
            c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        stream.close()

        def admitted() -> bool:
            try:
                return complete(c, PROMPT, stream=False, max_tokens=4, **GREEDY).finish_reason == "length"
            except openai.RateLimitError:
                return False
        assert wait_until(admitted, 10.0)
