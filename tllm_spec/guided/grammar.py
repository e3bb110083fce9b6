"""Grammar backend (llguidance, the ``guided`` extra): compile a request's grammar and follow it token by token.

Host-side only. A :class:`GrammarMatcher` holds one request's grammar state; it is advanced with the tokens the
engine accepted after each step and never touched inside the step. Masks are int32 bitmasks, one bit per token
(bit ``t % 32`` of word ``t // 32``), the layout llguidance, xgrammar and TensorRT-LLM share.
"""
from __future__ import annotations

import torch

from ..config import GuidedDecodingParams

BITS = 32


def bitmask_width(vocab_size: int) -> int:
    """int32 words per mask row."""
    return (vocab_size + BITS - 1) // BITS


def single_token(row: torch.Tensor) -> int | None:
    """The only token a mask row allows, or None when it allows several (or none). row [W] int32."""
    words = row.nonzero()
    if words.numel() != 1:
        return None
    index = int(words[0, 0])
    word = int(row[index]) & 0xFFFFFFFF
    return index * BITS + word.bit_length() - 1 if word & (word - 1) == 0 else None


def allows(row: torch.Tensor, token: int) -> bool:
    """Whether mask row [W] int32 allows ``token``."""
    return bool((int(row[token // BITS]) >> (token % BITS)) & 1)


class GrammarMatcher:
    """One request's grammar state (llguidance ``LLMatcher``)."""

    def __init__(self, matcher):
        self._matcher = matcher

    def fill(self, rows: torch.Tensor, index: int) -> None:
        """Write the mask of the tokens allowed next into ``rows[index]``. rows [N, W] int32, CPU, contiguous."""
        row = rows[index]
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def consume(self, token: int) -> None:
        """Advance by a token the last mask allowed."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"grammar refused token {token} it allowed: {self._matcher.get_error()}")

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self._matcher.get_error()}")

    def is_stopped(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        return self._matcher.is_stopped()

    def advance(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """Follow the tokens a step accepted. Returns (tokens to keep, finish reason): the grammar's completion
        keeps the token that completed it and drops the rest ("stop"); a token the grammar refuses (possible
        only under forced or relaxed acceptance) ends the request ("error")."""
        for i, token in enumerate(tokens):
            if self._matcher.try_consume_tokens([token]) != 1:
                return tokens[:i], "error"
            if self._matcher.is_stopped():
                return tokens[:i + 1], "stop"
        return tokens, None


class GrammarCompiler:
    """Compiles :class:`GuidedDecodingParams` for one tokenizer and vocabulary (llguidance)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None):
        try:
            import llguidance
            import llguidance.hf
        except ImportError:
            raise ImportError("guided decoding needs llguidance: pip install 'tllm_spec[guided]'") from None
        if tokenizer is None:
            raise ValueError("guided decoding needs the target's tokenizer (none was found in its directory)")
        if eos_token_id is None:
            raise ValueError("guided decoding needs an EOS token id (neither tokenizer nor config has one)")
        self._llguidance = llguidance
        self.vocab_size = vocab_size
        try:
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
        except (ValueError, RuntimeError) as err:
            raise ValueError(f"guided decoding: llguidance cannot use this tokenizer ({err})") from None

    def grammar(self, params: GuidedDecodingParams) -> str:
        """The llguidance grammar of ``params``; ValueError naming the problem if it is invalid."""
        ll = self._llguidance.LLMatcher
        if params.json_schema is not None:
            grammar = ll.grammar_from_json_schema(
                params.json_schema, overrides={"whitespace_flexible": params.json_whitespace_flexible})
        elif params.regex is not None:
            grammar = ll.grammar_from_regex(params.regex)
        else:
            grammar = ll.grammar_from_lark(params.lark)
        error = ll.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(f"invalid grammar: {error.strip()}")
        return grammar

    def matcher(self, params: GuidedDecodingParams) -> GrammarMatcher:
        """A fresh matcher at the start of ``params``' grammar."""
        matcher = self._llguidance.LLMatcher(self._tokenizer, self.grammar(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid grammar: {matcher.get_error()}")
        return GrammarMatcher(matcher)
