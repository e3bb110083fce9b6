"""Chat messages -> prompt text. A tokenizer with a ``chat_template`` renders it
(``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``); one without (the demo pair's)
gets the built-in template: every message as ``<|role|>\\ncontent\\n``, then ``<|assistant|>\\n`` for the reply::

    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    -> "<|system|>\\nBe brief.\\n<|user|>\\nHi\\n<|assistant|>\\n"
"""
from __future__ import annotations

import json
from collections.abc import Callable

from .errors import APIError


def builtin_chat_prompt(messages: list[dict], tools: list[dict] | None = None) -> str:
    """The built-in template; tools (OpenAI's definitions) go first as ``<|tools|>\n[...]\n``, an assistant
    message's tool calls as their JSON after its content."""
    head = f"<|tools|>\n{json.dumps(tools)}\n" if tools else ""
    return head + "".join(f"<|{m['role']}|>\n{m['content']}{_calls(m)}\n" for m in messages) + "<|assistant|>\n"


def _calls(message: dict) -> str:
    calls = message.get("tool_calls")
    return json.dumps([call.get("function", call) for call in calls]) if calls else ""


class ChatTemplate:
    """Renders chat messages for one tokenizer. When the tokenizer's own encoding starts with BOS, a BOS that the
    template writes is dropped from the text, so the prompt does not begin with two."""

    def __init__(self, tokenizer, encode: Callable[[str], list[int]]):
        self.tokenizer = tokenizer
        self.has_template = getattr(tokenizer, "chat_template", None) is not None
        bos = getattr(tokenizer, "bos_token", None)
        adds_bos = bos is not None and self.has_template and encode("x")[:1] == [tokenizer.bos_token_id]
        self._duplicate_bos = bos if adds_bos else None  # encode adds BOS itself: drop the template's

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt of ``messages``; ``tools`` (OpenAI's function definitions) go to the template too."""
        if not self.has_template:
            return builtin_chat_prompt(messages, tools)
        try:
            extra = {"tools": tools} if tools else {}
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        except Exception as err:  # noqa: BLE001 (jinja's TemplateError, or what a template raises on bad roles)
            raise APIError(400, f"the chat template refused the messages: {err}", "messages") from None
        if self._duplicate_bos and text.startswith(self._duplicate_bos):
            text = text[len(self._duplicate_bos):]
        return text
