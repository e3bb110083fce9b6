"""Incremental detokenization with stop strings: text deltas that never split a multi-byte character and never
show part of a stop string, and the exact cut where a stop string appears (even inside a step's K+1 tokens)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

_INCOMPLETE = "\ufffd"  # what a byte-level decoder yields for an unfinished UTF-8 sequence


class Detokenizer:
    """Decodes a request's output as it grows. ``push`` takes tokens one step at a time and returns how many of
    them to keep (fewer when a stop string ends inside them); ``text`` is the output so far, cut before a stop
    string; ``take_delta`` returns the text not yet handed out that is safe to show.

    A window of already decoded tokens (``prefix``..``read``) is decoded again with the new ones, so tokenizers
    that drop a leading space at the start of a sequence (SentencePiece) give the same text as decoding the
    whole output at once."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode, self.stop = decode, tuple(s for s in stop if s)  # decode: token ids -> text
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._prefix = self._read = 0  # decode window: ids[prefix:read] is decoded text already in self.text
        self._handed_out = 0  # characters of self.text returned by take_delta

    def push(self, tokens: Sequence[int]) -> int:
        """Append ``tokens``; returns how many of them belong to the output (all, unless a stop string ended at
        one of them: the output then ends with that token and the text before the stop string)."""
        if not self.stop:
            self.ids.extend(tokens)
            self._advance()
            return len(tokens)
        for i, token in enumerate(tokens):
            self.ids.append(token)
            before = len(self.text)
            self._advance()
            if self._cut_at_stop(before):
                return i + 1
        return len(tokens)

    def finish(self) -> None:
        """The output is complete: its text is the whole output decoded at once (what a non-streamed request
        returns), unless a stop string cut it."""
        if not self.stopped:
            self.text = self._decode(self.ids)

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet; while the request runs, the tail that could still become a stop string is
        held back."""
        end = len(self.text)
        if not finished and self.stop and not self.stopped:
            end = max(self._handed_out, end - (max(len(s) for s in self.stop) - 1))
        delta = self.text[self._handed_out:end]
        self._handed_out = end
        return delta

    def _advance(self) -> None:
        window = self._decode(self.ids[self._prefix:self._read])
        full = self._decode(self.ids[self._prefix:])
        if full.endswith(_INCOMPLETE) or len(full) < len(window):
            return  # wait for the rest of the character
        self.text += full[len(window):]
        self._prefix, self._read = self._read, len(self.ids)

    def _cut_at_stop(self, before: int) -> bool:
        """Cut the text before the first stop string that ends in what the last token added (``before``: the
        text's length until then)."""
        start = max(0, before - max(len(s) for s in self.stop) + 1)
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if not found:
            return False
        self.text, self.stopped = self.text[:min(found)], True
        self._handed_out = min(self._handed_out, len(self.text))
        return True
