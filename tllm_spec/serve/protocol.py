"""The OpenAI API subset served: request bodies (unknown fields ignored, as OpenAI clients send some; wrong types
refused) and the responses and stream chunks. Sampling fields map onto :class:`SamplingParams`: ``max_tokens`` ->
``max_new_tokens``; ``temperature`` (default 1, as OpenAI's), ``top_p``, ``seed``; ``stop`` (a string or a list);
vLLM's extras ``top_k`` (-1 or 0 = off), ``ignore_eos``, ``stop_token_ids`` and
``stream_options.continuous_usage_stats``; completions' ``logprobs: N`` and chat's ``logprobs: true, top_logprobs:
N`` (N <= 20) -> ``logprobs``, answered in OpenAI's shapes (serve/logprobs.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import SamplingParams
from ..sampling.logprobs import MAX_LOGPROBS
from .errors import APIError

FinishReason = Literal["stop", "length"]
_API_NAMES = {"max_new_tokens": "max_tokens"}  # SamplingParams field -> the request field it came from


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class _GenerationRequest(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None

    def refuse_unsupported(self) -> None:
        """400 for a field whose meaning this server does not implement (rather than ignore it)."""
        refusals = {"n": (self.n not in (None, 1), "n > 1 is not supported (one choice per request)"),
                    "min_tokens": ((self.min_tokens or 0) > 0, "min_tokens is not supported yet"),
                    "frequency_penalty": (bool(self.frequency_penalty), "frequency_penalty is not supported yet"),
                    "presence_penalty": (bool(self.presence_penalty), "presence_penalty is not supported yet")}
        for param, (refused, message) in refusals.items():
            if refused:
                raise APIError(400, message, param)

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

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams; a value it refuses (max_tokens < 1, temperature > 100) is a 400 naming the
        request field."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        max_tokens = self.requested_max_tokens
        fields = {"max_new_tokens": max_tokens if max_tokens is not None else default_max_tokens,
                  "temperature": 1.0 if self.temperature is None else self.temperature,
                  "top_p": 1.0 if self.top_p is None else self.top_p,
                  "top_k": 0 if self.top_k in (None, -1) else self.top_k, "stop": stop,
                  "stop_token_ids": tuple(self.stop_token_ids or ()), "ignore_eos": self.ignore_eos,
                  "seed": self.seed, "logprobs": self.requested_logprobs}
        try:
            return SamplingParams(**fields)
        except ValidationError as err:
            first = err.errors()[0]
            param = _API_NAMES.get(str(first["loc"][0]), str(first["loc"][0])) if first["loc"] else None
            raise APIError(400, f"{param}: {first['msg']} (got {first['input']!r})", param) from None


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions: one prompt, text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        _check_logprobs("logprobs", self.logprobs)
        if self.echo:
            raise APIError(400, "echo is not supported yet", "echo")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of > 1 is not supported", "best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")

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
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" for part in self.content):
            raise APIError(400, "only text content parts are supported", "messages")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

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

    def text_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def _check_logprobs(param: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{param} must lie in [0, {MAX_LOGPROBS}], got {value}", param)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int) -> Usage:
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                   total_tokens=num_prompt_tokens + num_completion_tokens)


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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
