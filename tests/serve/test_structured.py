"""Structured outputs and tool calls through the API, decoded with speculation (the demo pair's EAGLE-3 head):
each constraint holds, equals the offline engine's constrained greedy output, and a bad one is a 400."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tllm_spec import GuidedDecodingParams, SamplingParams

from .inprocess import post, with_client

pytest.importorskip("llguidance")

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "now", "description": "the time"}}]
GREEDY = {"temperature": 0, "max_tokens": 80}


def _completion(demo_app, **body) -> dict:
    status, answer = post(demo_app, "/v1/completions", {"prompt": "x = ", **GREEDY, **body})
    assert status == 200, answer
    return answer["choices"][0]


def test_json_schema_and_json_object_hold(demo_app):
    model, _ = demo_app
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    status, answer = post(demo_app, "/v1/chat/completions", {"messages": USER, "response_format": response_format,
                                                             **GREEDY})
    assert status == 200, answer
    jsonschema.validate(json.loads(answer["choices"][0]["message"]["content"]), SCHEMA)
    expected = model.generate([answer_prompt := "x = "], SamplingParams(
        max_new_tokens=80, guided_decoding=GuidedDecodingParams(json_schema=SCHEMA)))[0].text
    assert _completion(demo_app, guided_json=SCHEMA)["text"] == expected == \
        _completion(demo_app, structured_outputs={"json": SCHEMA})["text"], answer_prompt
    status, answer = post(demo_app, "/v1/chat/completions", {"messages": USER, **GREEDY,
                                                             "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(answer["choices"][0]["message"]["content"]), dict)


def test_regex_choice_and_grammar_hold(demo_app):
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", _completion(demo_app, guided_regex="[0-9]{3}-[a-z]{2}")["text"])
    choices = ["yes (sure)", "no.", "a+b*c"]
    assert _completion(demo_app, guided_choice=choices)["text"] in choices
    assert _completion(demo_app, structured_outputs={"choice": choices})["text"] in choices
    grammar = 'start: "let " NAME " = " NUMBER\nNAME: /[a-z]+/\nNUMBER: /[0-9]+/'
    assert re.fullmatch(r"let [a-z]+ = [0-9]+", _completion(demo_app, guided_grammar=grammar)["text"])


@pytest.mark.parametrize("body, param", [
    ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
])
def test_bad_constraints_are_a_400_naming_the_field(demo_app, body, param):
    status, answer = post(demo_app, "/v1/completions", {"prompt": "x", **body})
    assert status == 400 and answer["error"]["param"] == param, answer


def test_tool_choice_required_and_named_make_tool_calls(demo_app):
    async def calls(client):
        required = await client.chat.completions.create(model="tllm-spec-demo", messages=USER, tools=TOOLS,
                                                        tool_choice="required", **GREEDY)
        named = await client.chat.completions.create(model="tllm-spec-demo", messages=USER, tools=TOOLS,
                                                     tool_choice={"type": "function",
                                                                  "function": {"name": "get_weather"}}, **GREEDY)
        return required.choices[0], named.choices[0]
    required, named = with_client(demo_app, calls)
    for choice in (required, named):
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            if call.function.name == "get_weather":
                jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
            else:
                assert call.function.name == "now" and isinstance(json.loads(call.function.arguments), dict)
    assert [c.function.name for c in named.message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_add_up_to_the_whole_response(demo_app, tool_choice):
    async def both(client):
        whole = await client.chat.completions.create(model="tllm-spec-demo", messages=USER, tools=TOOLS,
                                                     tool_choice=tool_choice, **GREEDY)
        calls: dict[int, dict] = {}
        finish = None
        async for chunk in await client.chat.completions.create(model="tllm-spec-demo", messages=USER, tools=TOOLS,
                                                                tool_choice=tool_choice, stream=True, **GREEDY):
            for delta in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        return whole.choices[0].message.tool_calls, calls, finish
    whole, streamed, finish = with_client(demo_app, both)
    assert finish == "tool_calls"
    assert [{"name": c.function.name, "arguments": c.function.arguments} for c in whole] == \
        [streamed[i] for i in sorted(streamed)]


def test_tool_choice_auto_and_tool_messages(demo_app):
    status, answer = post(demo_app, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, **GREEDY})
    assert status == 400 and answer["error"]["param"] == "tool_choice" and "auto" in answer["error"]["message"]
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    status, answer = post(demo_app, "/v1/chat/completions", {"messages": history, "tools": TOOLS,
                                                             "tool_choice": "none", **GREEDY})
    assert status == 200 and answer["choices"][0]["message"]["content"], answer
