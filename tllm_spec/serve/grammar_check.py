"""GrammarCheck: a request's grammar compiled before it is admitted, so that one llguidance refuses answers 400
naming the problem instead of a stream that starts and then fails. The compiler is made on first use (it needs
the ``guided`` extra, and building it reads the whole vocabulary), from any thread."""
from __future__ import annotations

import threading

from ..config import GuidedDecodingParams
from ..guided.grammar import GrammarCompiler


class GrammarCheck:
    def __init__(self, runner):
        self.runner = runner
        self._compiler: GrammarCompiler | None = None
        self._unavailable: str | None = None
        self._lock = threading.Lock()

    def check(self, params: GuidedDecodingParams) -> str | None:
        """Why ``params``' grammar cannot be used (None: it compiles)."""
        compiler = self._get()
        if compiler is None:
            return f"structured outputs are unavailable on this server: {self._unavailable}"
        try:
            compiler.grammar(params)
        except ValueError as err:
            return str(err)
        return None

    def _get(self) -> GrammarCompiler | None:
        with self._lock:
            if self._compiler is None and self._unavailable is None:
                try:
                    self._compiler = self.runner.grammar_compiler()
                except (ImportError, ValueError) as err:
                    self._unavailable = str(err)
            return self._compiler
