"""The app in-process (httpx's ASGI transport): an MTP model, a tokenizer's own chat template, the built-in one."""
from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from tllm_spec import MTPConfig, SamplingParams, SpecModel
from tllm_spec.serve.app import build_app
from tllm_spec.serve.template import ChatTemplate, builtin_chat_prompt

TEMPLATE = ("{% for m in messages %}## {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}## assistant:{% endif %}")


@pytest.fixture(scope="module")
def mtp_model() -> SpecModel:
    spec = MTPConfig(num_nextn_predict_layers=1, max_draft_len=3, mtp_checkpoint="demo://mtp")
    return SpecModel.from_pretrained("demo://target", spec, dtype=torch.float32, device="cpu", max_batch_size=4)


def _post(model: SpecModel, path: str, body: dict) -> dict:
    async def send() -> dict:
        transport = httpx.ASGITransport(app=build_app(model, "mtp"))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.post(path, json={"model": "mtp", **body})
            assert response.status_code == 200, response.text
            return response.json()
    return asyncio.run(send())


def test_an_mtp_model_serves_what_it_decodes_offline(mtp_model):
    prompt = "import os\n\n\nclass "
    expected = mtp_model.generate([prompt], SamplingParams(max_new_tokens=20))[0].text
    response = _post(mtp_model, "/v1/completions", {"prompt": prompt, "max_tokens": 20, "temperature": 0})
    assert response["choices"][0]["text"] == expected


def test_a_tokenizer_chat_template_renders_the_prompt(mtp_model):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    mtp_model.tokenizer.chat_template = TEMPLATE
    try:
        response = _post(mtp_model, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0})
    finally:
        mtp_model.tokenizer.chat_template = None
    prompt = "## user: def add(a, b):\n## assistant:"
    assert response["usage"]["prompt_tokens"] == len(mtp_model.encode(prompt))
    assert response["choices"][0]["message"]["content"] == \
        mtp_model.generate([prompt], SamplingParams(max_new_tokens=12))[0].text


def test_the_builtin_template():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert builtin_chat_prompt(messages) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"


class _BosTokenizer:
    """A tokenizer whose encode adds BOS and whose chat template writes it too."""

    chat_template, bos_token, bos_token_id = "...", "<s>", 1

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "<s>" + "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"


def test_a_template_bos_is_dropped_when_encoding_adds_one():
    messages = [{"role": "user", "content": "hi"}]
    assert ChatTemplate(_BosTokenizer(), lambda text: [1, 7]).render(messages) == "[user]hi[assistant]"
    assert ChatTemplate(_BosTokenizer(), lambda text: [7]).render(messages) == "<s>[user]hi[assistant]"


def test_the_server_shortens_the_gil_switch_interval(mtp_model, monkeypatch):
    """The engine's thread must not wait Python's default 5 ms for the GIL while the event loop writes chunks."""
    import sys

    from tllm_spec.serve.app import GIL_SWITCH_INTERVAL_S
    intervals: list[float] = []
    monkeypatch.setattr(sys, "setswitchinterval", intervals.append)
    monkeypatch.setattr(sys, "getswitchinterval", lambda: 0.005)  # Python's default
    build_app(mtp_model, "mtp")
    assert intervals == [GIL_SWITCH_INTERVAL_S] and GIL_SWITCH_INTERVAL_S <= 0.001


def test_completion_requests_are_announced_until_submitted_or_refused(mtp_model, monkeypatch):
    """The engine counts a completion request as on its way from the moment the server reads it until it is
    submitted (or refused): an idle engine waits for it to start a burst together. Nothing stays counted."""
    import tllm_spec.engine.async_engine as async_engine
    seen, checked = [], []
    engine = mtp_model.engine
    original = engine.add
    check_prompt = async_engine.check_prompt

    def check(*args):
        checked.append(engine.admission.num_incoming())  # while the server checks it: announced
        return check_prompt(*args)
    monkeypatch.setattr(async_engine, "check_prompt", check)

    def add(*args, **kwargs):
        seen.append(engine.admission.num_incoming())  # on the engine's thread, when the request arrives there
        return original(*args, **kwargs)
    engine.add = add
    try:
        async def send() -> list[int]:
            transport = httpx.ASGITransport(app=build_app(mtp_model, "mtp"))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                body = {"model": "mtp", "prompt": "def f(x):", "max_tokens": 6, "temperature": 0}
                codes = [(await client.post("/v1/completions", json=body)).status_code,
                         (await client.post("/v1/completions", json={**body, "stream": True})).status_code,
                         (await client.post("/v1/completions", json={**body, "max_tokens": -1})).status_code,
                         (await client.post("/v1/completions", json={**body, "model": "other"})).status_code]
                return codes
        assert asyncio.run(send()) == [200, 200, 400, 404]
    finally:
        engine.add = original
    assert len(checked) >= 2 and set(checked) == {1} and seen == [0, 0]  # settled by the submit, before the engine
    # took the request
    assert engine.admission.num_incoming() == 0
