"""The request bodies of POST /v1/completions and /v1/chat/completions, and what the server does with each field.

Every field of OpenAI's two requests, and each vLLM extra the server takes, is in exactly one of three sets
(``tests/serve/test_fields.py`` walks the ``openai`` package's request types against them):

* **honoured** (:data:`COMPLETION_FIELDS` / :data:`CHAT_FIELDS`): sampling maps onto :class:`SamplingParams`
  (``max_tokens`` / ``max_completion_tokens`` -> ``max_new_tokens``; ``temperature``, default 1 as OpenAI's;
  ``top_p``, ``seed``, ``stop``; vLLM's ``top_k`` (-1 or 0 = off), ``ignore_eos``, ``stop_token_ids``), logprobs
  (completions' ``logprobs: N``, chat's ``logprobs: true, top_logprobs: N``, N <= 20), streaming
  (``stream_options.include_usage``, vLLM's ``continuous_usage_stats``), structured outputs (``response_format``,
  vLLM's ``guided_json`` / ``guided_regex`` / ``guided_grammar`` / ``guided_choice`` / ``structured_outputs``:
  serve/structured.py), tool calls (``tools``, ``tool_choice``, ``parallel_tool_calls``: serve/tool_calls.py)
  and vLLM's ``cache_salt`` (a non-empty string -> ``SamplingParams.cache_salt``: only requests of the same salt
  share cached prompt pages);
* **informational** (:data:`INFORMATIONAL`): accepted and without effect on the output (identifiers, caching
  hints and tags: nothing here stores requests, and the prefix cache finds a shared prefix by its tokens, with no
  key);
* **refused** (:data:`REFUSED`): a 400 naming the field when it holds anything but its neutral value.

A field in none of the sets is refused as unknown unless it is null."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import SamplingParams
from ..sampling.logprobs import MAX_LOGPROBS
from .errors import APIError

_API_NAMES = {"max_new_tokens": "max_tokens"}  # SamplingParams field -> the request field it came from
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]

INFORMATIONAL = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                           "prompt_cache_options", "service_tier"})
REFUSED: dict[str, tuple[object, str]] = {  # field -> (its neutral value, why another value is refused)
    "n": (1, "n > 1 is not supported (one choice per request)"),
    "best_of": (1, "best_of > 1 is not supported"),
    "echo": (False, "echo is not supported"),
    "suffix": ("", "suffix is not supported"),
    "min_tokens": (0, "min_tokens is not supported"),
    "frequency_penalty": (0, "frequency_penalty is not supported: only 0 is accepted"),
    "presence_penalty": (0, "presence_penalty is not supported: only 0 is accepted"),
    "repetition_penalty": (1, "repetition_penalty is not supported: only 1 is accepted"),
    "logit_bias": ({}, "logit_bias is not supported (for a fixed set of outputs use guided_choice or "
                   "response_format)"),
    "audio": (None, "audio output is not supported (text only)"),
    "modalities": (["text"], "only the 'text' modality is supported"),
    "prediction": (None, "predicted outputs (prediction) are not supported"),
    "functions": ([], "functions is deprecated and not supported: use tools"),
    "function_call": (None, "function_call is deprecated and not supported: use tool_choice"),
    "reasoning_effort": (None, "reasoning_effort is not supported"),
    "verbosity": (None, "verbosity is not supported"),
    "web_search_options": (None, "web search is not supported"),
    "store": (False, "store is not supported: this server keeps no completions"),
    "moderation": (None, "moderation is not supported"),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class GenerationRequest(_Body):
    """Fields shared by completions and chat completions. Refused and informational fields are typed ``Any``:
    whatever a client sends there, the answer is the set's (a clear 400, or nothing)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: prefix-cache isolation (tenants)

    def refuse_unsupported(self) -> None:
        """400 for a refused field that is set, or a field the server does not know (rather than ignore it)."""
        extra = self.model_extra or {}
        for name, value in {**dict(self), **extra}.items():
            if value is None:
                continue
            if name in REFUSED and value != REFUSED[name][0]:
                raise APIError(400, REFUSED[name][1], name)
            if name in extra and name not in REFUSED and name not in INFORMATIONAL:
                raise APIError(400, f"unknown field {name!r}: not an OpenAI parameter nor a vLLM extra this server "
                               "takes", name)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (off), or the number of top entries per token."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_params(self, max_new_tokens: int, **extra: object) -> SamplingParams:
        """The engine's SamplingParams; a value it refuses (max_tokens < 1, temperature > 100) is a 400 naming the
        request field."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        fields = {"max_new_tokens": max_new_tokens, "temperature": 1.0 if self.temperature is None else self.temperature,
                  "top_p": 1.0 if self.top_p is None else self.top_p,
                  "top_k": 0 if self.top_k in (None, -1) else self.top_k, "stop": stop,
                  "stop_token_ids": tuple(self.stop_token_ids or ()), "ignore_eos": self.ignore_eos,
                  "seed": self.seed, "logprobs": self.requested_logprobs, "cache_salt": self.cache_salt,
                  **extra}
        try:
            return SamplingParams(**fields)
        except ValidationError as err:
            first = err.errors()[0]
            param = _API_NAMES.get(str(first["loc"][0]), str(first["loc"][0])) if first["loc"] else None
            raise APIError(400, f"{param}: {first['msg']} (got {first['input']!r})", param) from None


class CompletionRequest(GenerationRequest):
    """POST /v1/completions: one prompt, text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    user: Any = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        _check_logprobs("logprobs", self.logprobs)

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The prompt; a list of prompts is refused unless it holds exactly one."""
        prompt = self.prompt
        if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
            return prompt
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request: send a string or one list of token ids", "prompt")
        return prompt[0]


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    """One message; roles outside :data:`ChatRole` are refused. An assistant message may carry the tool calls
    it made, a tool message the id of the call it answers."""

    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" for part in self.content):
            raise APIError(400, "only text content parts are supported", "messages")
        return "".join(part.text or "" for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: text content, a developer message as a system one, and tool
        calls' arguments as objects (templates write them with ``tojson``)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [_parsed_arguments(call) for call in self.tool_calls]
        return message


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
    except json.JSONDecodeError:
        raise APIError(400, f"a tool call's arguments are not JSON: {function['arguments'][:80]!r}",
                       "messages") from None


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: Any = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        _check_logprobs("top_logprobs", self.top_logprobs)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


def _check_logprobs(param: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{param} must lie in [0, {MAX_LOGPROBS}], got {value}", param)


COMPLETION_FIELDS = frozenset(CompletionRequest.model_fields) - INFORMATIONAL
CHAT_FIELDS = frozenset(ChatCompletionRequest.model_fields) - INFORMATIONAL
