"""Tool calls: ``tools`` with ``tool_choice`` "required" or a named function, as vLLM's named and required
function calling do. The output is constrained to JSON (serve/structured.py) and answered as ``message.tool_calls``
with ``finish_reason`` "tool_calls":

* a named function ``{"type": "function", "function": {"name": N}}``: the output is N's arguments, valid under
  its ``parameters`` schema; streamed as one call whose ``arguments`` grow with each chunk;
* "required": the output is a JSON array of ``{"name": ..., "parameters": {...}}``, one or more calls of the
  given tools (one at most with ``parallel_tool_calls: false``); streamed as whole calls once the array is
  complete.

``tool_choice`` "none" renders the tools into the prompt and answers text. "auto" needs a parser for the served
model's own tool-call format, which this server does not have: it is refused with a 400 (as is ``tools``
without ``tool_choice``, whose OpenAI default is "auto")."""
from __future__ import annotations

import json
import uuid
from typing import Any

from .errors import APIError
from .protocol import DeltaMessage, DeltaToolCall, FunctionCall, ToolCall
from .requests import ChatCompletionRequest

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def tool_call_format(body: ChatCompletionRequest) -> ToolCallFormat | None:
    """How the request's tool calls are constrained and answered; None when it makes none."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    if choice in (None, "auto"):
        raise APIError(400, "tool_choice 'auto' (the default with tools) is not supported: this server has no "
                       "parser for the served model's tool-call format; send tool_choice 'required' or "
                       "{'type': 'function', 'function': {'name': ...}} (the output is then constrained to the "
                       "function's JSON schema), or 'none'", "tool_choice")
    functions = {tool.function.name: tool.function.parameters or EMPTY_PARAMETERS for tool in body.tools}
    if choice == "required":
        return ToolCallFormat(functions, named=None, single=body.parallel_tool_calls is False)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if choice.get("type") != "function" or name not in functions:
        raise APIError(400, f"tool_choice must name one of the tools ({', '.join(functions)}) as "
                       "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    return ToolCallFormat(functions, named=name, single=True)


class ToolCallFormat:
    """One request's tool calls: the JSON schema its output follows, and its output as tool calls."""

    def __init__(self, functions: dict[str, dict[str, Any]], named: str | None, single: bool):
        self.functions, self.named, self.single = functions, named, single
        self._ids: list[str] = []

    def schema(self) -> dict[str, Any]:
        if self.named is not None:
            return self.functions[self.named]
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                  "required": ["name", "parameters"]} for name, params in self.functions.items()]
        return {"type": "array", "minItems": 1, **({"maxItems": 1} if self.single else {}),
                "items": {"anyOf": calls}}

    def calls(self, text: str) -> list[ToolCall] | None:
        """The tool calls of the whole output; None if it does not parse (an output cut by max_tokens)."""
        if self.named is not None:
            return [ToolCall(id=self._id(0), function=FunctionCall(name=self.named, arguments=text))]
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [ToolCall(id=self._id(i), function=FunctionCall(name=item["name"],
                                                               arguments=json.dumps(item["parameters"])))
                for i, item in enumerate(items)]

    def message(self, text: str, finish_reason: str) -> tuple[str | None, list[ToolCall] | None, str]:
        """(content, tool_calls, finish_reason) of the response: the calls, or the text when the output did not
        complete (finish "length")."""
        calls = self.calls(text) if finish_reason == "stop" or self.named is not None else None
        if calls is None:
            return text, None, finish_reason
        return None, calls, "tool_calls" if finish_reason == "stop" else finish_reason

    def delta(self, new_text: str, text: str, first: bool, finish_reason: str | None
              ) -> tuple[DeltaMessage, str | None] | None:
        """A stream chunk's delta and finish reason, or None for nothing to send yet. ``new_text``: the text this
        step added; ``text``: all of it so far."""
        if self.named is not None:
            if not new_text and not first and finish_reason is None:
                return None
            call = DeltaToolCall(index=0, function=FunctionCall(arguments=new_text))
            if first:
                call = DeltaToolCall(index=0, id=self._id(0), type="function",
                                     function=FunctionCall(name=self.named, arguments=new_text))
            return DeltaMessage(role="assistant" if first else None, tool_calls=[call]), \
                self._finish(finish_reason)
        if finish_reason is None:
            return None
        content, calls, reason = self.message(text, finish_reason)
        deltas = [DeltaToolCall(index=i, id=c.id, type="function", function=c.function) for i, c in
                  enumerate(calls or [])]
        return DeltaMessage(role="assistant" if first else None, content=content, tool_calls=deltas or None), reason

    @staticmethod
    def _finish(finish_reason: str | None) -> str | None:
        return "tool_calls" if finish_reason == "stop" else finish_reason

    def _id(self, index: int) -> str:
        while len(self._ids) <= index:
            self._ids.append(f"call_{uuid.uuid4().hex[:24]}")
        return self._ids[index]
