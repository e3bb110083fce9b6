"""No request field silently ignored: every field of the ``openai`` package's completion and chat-completion
request types is honoured, informational or refused (a field added there fails this test until it is decided),
refused ones answer 400 naming themselves, and unknown fields are refused too."""
from __future__ import annotations

import typing

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from tllm_spec.serve.requests import CHAT_FIELDS, COMPLETION_FIELDS, INFORMATIONAL, REFUSED

from .inprocess import post

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "def f(x):", "max_tokens": 2}
ENDPOINTS = {"/v1/completions": (COMPLETION, completion_create_params.CompletionCreateParamsStreaming,
                                 COMPLETION_FIELDS),
             "/v1/chat/completions": (CHAT, chat_create_params.CompletionCreateParamsStreaming, CHAT_FIELDS)}


@pytest.mark.parametrize("path", ENDPOINTS)
def test_every_openai_field_is_decided(path):
    _, request_type, honoured = ENDPOINTS[path]
    openai_fields = set(typing.get_type_hints(request_type))
    undecided = openai_fields - honoured - INFORMATIONAL - set(REFUSED)
    assert not undecided, f"{path}: decide {sorted(undecided)} (honour it, or add it to REFUSED / INFORMATIONAL)"
    assert not (honoured & set(REFUSED)) and not (honoured & INFORMATIONAL)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_refused_fields_answer_400_naming_themselves(demo_app, path):
    body, request_type, _ = ENDPOINTS[path]
    for field in sorted(set(typing.get_type_hints(request_type)) & set(REFUSED)):
        status, answer = post(demo_app, path, {**body, field: 7})
        assert status == 400 and answer["error"]["param"] == field, (field, answer)
        assert post(demo_app, path, {**body, field: REFUSED[field][0]})[0] == 200, field  # the neutral value


@pytest.mark.parametrize("path", ENDPOINTS)
def test_informational_fields_are_accepted(demo_app, path):
    body = {**ENDPOINTS[path][0], **{field: "tag" for field in INFORMATIONAL}}
    assert post(demo_app, path, body)[0] == 200


def test_unknown_fields_are_refused_unless_null(demo_app):
    status, answer = post(demo_app, "/v1/completions", {**COMPLETION, "some_future_field": [1, 2]})
    assert status == 400 and answer["error"]["param"] == "some_future_field"
    assert post(demo_app, "/v1/completions", {**COMPLETION, "some_future_field": None})[0] == 200
    status, answer = post(demo_app, "/v1/completions", {**COMPLETION, "repetition_penalty": 1.2})
    assert status == 400 and answer["error"]["param"] == "repetition_penalty"


def test_cache_salt_is_a_non_empty_string(demo_app):
    for salt in (3, True, ["tenant"], "", "x" * 1025):  # at most 1024 characters (SamplingParams.cache_salt)
        status, answer = post(demo_app, "/v1/completions", {**COMPLETION, "cache_salt": salt})
        assert status == 400 and answer["error"]["param"] == "cache_salt", (salt, answer)
    assert post(demo_app, "/v1/chat/completions", {**CHAT, "cache_salt": "tenant-a"})[0] == 200


def test_max_tokens_beyond_the_context_is_refused_with_the_arithmetic(demo_app):
    status, answer = post(demo_app, "/v1/completions", {"prompt": [7] * 100, "max_tokens": 10**9})
    assert status == 400 and answer["error"]["param"] == "max_tokens"
    assert "2048" in answer["error"]["message"] and "at most 1948" in answer["error"]["message"]
    status, answer = post(demo_app, "/v1/chat/completions", {**CHAT, "max_tokens": None,
                                                             "max_completion_tokens": 5000})
    assert status == 400 and answer["error"]["param"] == "max_completion_tokens"
    status, answer = post(demo_app, "/v1/completions", {"prompt": [7] * 2040, "max_tokens": 8})
    assert status == 200 and answer["usage"]["completion_tokens"] == 8  # exactly what fits


def test_chat_roles_and_content_type(demo_app):
    status, answer = post(demo_app, "/v1/chat/completions", {**CHAT, "messages": [{"role": "bogus", "content": "x"}]})
    assert status == 400 and answer["error"]["param"] == "messages" and "'user'" in answer["error"]["message"]
    assert post(demo_app, "/v1/chat/completions", {**CHAT, "messages": [{"role": "developer", "content": "x"},
                                                                        {"role": "user", "content": "y"}]})[0] == 200
    status, answer = post(demo_app, "/v1/completions", None, content=b'{"prompt": "x"}',
                          headers={"content-type": "text/plain"})
    assert status == 400 and "Content-Type" in answer["error"]["message"]
