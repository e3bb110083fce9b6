"""The engine's token logprobs in OpenAI's shapes: completions' ``{tokens, token_logprobs, top_logprobs,
text_offset}`` and chat's ``{content: [{token, logprob, bytes, top_logprobs}]}``. A token's text is the tokenizer's
decoding of its id alone (special tokens included), as vLLM's; a logprob of -inf (a token a grammar forbids, among
the top N) is sent as -9999.0, as vLLM does (JSON has no infinity)."""
from __future__ import annotations

from collections.abc import Callable

from .protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

_MIN_LOGPROB = -9999.0


class TokenTexts:
    """Token id -> its text, cached; misses are decoded together by ``decode_each`` (list of ids -> their
    texts; the engine's, which holds the tokenizer's lock)."""

    def __init__(self, decode_each: Callable[[list[int]], list[str]]):
        self.decode_each = decode_each
        self.cache: dict[int, str] = {}

    def __call__(self, token_ids: list[int]) -> list[str]:
        missing = sorted({t for t in token_ids if t not in self.cache})
        if missing:
            self.cache.update(zip(missing, self.decode_each(missing)))
        return [self.cache[t] for t in token_ids]


class LogprobsFormat:
    """One request's logprobs in its endpoint's shape; completions' text offsets run on from chunk to chunk."""

    def __init__(self, chat: bool, token_texts: TokenTexts):
        self.chat, self.token_texts = chat, token_texts
        self.text_offset = 0  # completions: where the next token starts in the completion's text

    def __call__(self, token_ids: list[int], logprobs: list[float], top_logprobs: list[dict[int, float]]
                 ) -> CompletionLogprobs | ChatLogprobs:
        """token_ids [n]; logprobs [n]; top_logprobs [n] {token id: logprob} best first."""
        texts = self.token_texts(token_ids)
        tops = [list(zip(self.token_texts(list(top)), map(_finite, top.values()))) for top in top_logprobs]
        chosen = [_finite(v) for v in logprobs]
        return self._chat(texts, chosen, tops) if self.chat else self._completion(texts, chosen, tops)

    def _completion(self, texts: list[str], logprobs: list[float], tops: list[list[tuple[str, float]]]
                    ) -> CompletionLogprobs:
        offsets = []
        for text in texts:
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        top_dicts = [_with_token(top, text, value) for text, value, top in zip(texts, logprobs, tops)]
        return CompletionLogprobs(tokens=texts, token_logprobs=logprobs, top_logprobs=top_dicts, text_offset=offsets)

    @staticmethod
    def _chat(texts: list[str], logprobs: list[float], tops: list[list[tuple[str, float]]]) -> ChatLogprobs:
        content = [TokenLogprob(token=text, logprob=value, bytes=_bytes(text),
                                top_logprobs=[TopLogprob(token=t, logprob=v, bytes=_bytes(t)) for t, v in top])
                   for text, value, top in zip(texts, logprobs, tops)]
        return ChatLogprobs(content=content)


def _with_token(top: list[tuple[str, float]], text: str, logprob: float) -> dict[str, float]:
    """{text: logprob} of the top N and of the token itself (up to N + 1 entries, as OpenAI's and vLLM's)."""
    entries = dict(top)
    entries.setdefault(text, logprob)
    return entries


def _finite(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))
