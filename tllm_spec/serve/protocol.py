"""The responses and stream chunks of the OpenAI API subset served (the request bodies: serve/requests.py):
completions, chat completions (a message's text or its ``tool_calls``), usage (with OpenAI's
``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache served), logprobs in OpenAI's shapes
(serve/logprobs.py) and the model list."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

FinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V the prefix cache held (not prefilled): whole pages


class Usage(BaseModel):
    """OpenAI's usage, ``prompt_tokens_details.cached_tokens`` included."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = None) -> Usage:
        details = None if num_cached_tokens is None else PromptTokensDetails(cached_tokens=num_cached_tokens)
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                   total_tokens=num_prompt_tokens + num_completion_tokens, prompt_tokens_details=details)


class _Response(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: per token its text, logprob, {text: logprob} of the top N (and of the token itself)
    and where it starts in the completion's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(_Response):
    """The whole completion, and (same shape, OpenAI's "text_completion" object) each streamed chunk."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class FunctionCall(BaseModel):
    name: str | None = None  # a stream's later deltas of one call carry its arguments only
    arguments: str = ""  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tllm_spec"
    max_model_len: int
    vocab_size: int  # prompt token ids lie in [0, vocab_size) (not OpenAI's; tllm-spec bench-serve draws from it)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
