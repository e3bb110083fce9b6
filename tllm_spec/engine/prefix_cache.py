"""Automatic prefix caching: a prompt page whose K/V another request already wrote is shared, not prefilled again.

A full page is named by a chained key, sha256 of (the key before it, the page's tokens, the ``lookahead`` tokens
after it); the chain starts from what else changes the K/V (the drafter, the dtype, the page size) and the
request's ``cache_salt``. The lookahead is the drafter's (SpecWorkerBase.kv_lookahead): an EAGLE-3 head's or
MTP-Eagle module's K/V at position p reads token p + 1, vanilla MTP's module N reads token p + N, so a page's
draft K/V is only valid after the same tokens; a draft LM and plain decoding read none (0). Target and draft K/V
share a page, so one key covers both and nothing is reused that the draft cannot reuse.

What is cached: prompt pages, once the step that prefilled them has completed (:meth:`PrefixCache.publish`;
never earlier, so a page is read only after it is written), those whose key's tokens all lie in the prompt; and
when a request ends with its whole text, the pages of its prompt and output whose K/V are final
(:meth:`PrefixCache.publish_finished`): positions below the committed length whose lookahead tokens were
accepted too (a draft's K/V past the last accepted token comes from drafted inputs and is never published). A
request reuses its longest run of cached pages, leaving at least max(1, lookahead) prompt tokens to compute, so
its last prompt token's logits and its draft's first pass exist. A waiting request whose next page another
request is prefilling right now waits for it (:meth:`PrefixCache.waits_for_writer`): a burst behind one new
shared prefix prefills it once.

The pool's side (refcounts, eviction) is :class:`~tllm_spec.model.page_pool.PagePool`; the runner never knows:
a request that reused a prefix runs as a prompt chunk that starts past position 0, as chunked prefill does.
"""
from __future__ import annotations

import hashlib
from array import array

from typing import TYPE_CHECKING

from ..drafts.base import SpecWorkerBase
from ..model.kv_cache import KVCache
from .request import Request

if TYPE_CHECKING:
    from .runner import ModelRunner


class PrefixCache:
    """The engine's prefix cache over its KV pool (off: nothing is shared, every prompt prefills from its first
    token, and it only allocates). ``queries`` and ``hits`` count prompt tokens looked up at admission and
    found cached (Prometheus counters)."""

    def __init__(self, kv: KVCache, worker: SpecWorkerBase, enabled: bool, namespace: str = ""):
        self.kv, self.worker, self.enabled = kv, worker, enabled
        self.page_size, self.lookahead = kv.page_size, worker.kv_lookahead
        self.namespace = f"{namespace}|page_size={kv.page_size}|lookahead={self.lookahead}".encode()
        self.queries = self.hits = 0

    @classmethod
    def of(cls, runner: ModelRunner) -> PrefixCache:
        """The runner's cache: EngineConfig.enable_prefix_caching (default: on for a GPU, off for the CPU)."""
        enabled = runner.engine_config.enable_prefix_caching
        kv = runner.kv_cache
        namespace = f"{type(runner.worker).__name__}|{kv.k[0].dtype}|{len(kv.k)} layers"
        return cls(kv, runner.worker, runner.device.type == "cuda" if enabled is None else enabled, namespace)

    def page_keys(self, prompt: list[int], salt: str | None) -> list[bytes]:
        """Keys of the prompt's pages whose tokens and lookahead all lie in the prompt, first page first."""
        parent = hashlib.sha256(self.namespace + b"|salt=" + (salt or "").encode()).digest()
        keys, size = [], self.page_size
        tokens = array("q", prompt).tobytes()
        for end in range(size, len(prompt) - self.lookahead + 1, size):
            parent = hashlib.sha256(parent + tokens[8 * (end - size):8 * (end + self.lookahead)]).digest()
            keys.append(parent)
        return keys

    def _keys(self, request: Request) -> list[bytes]:
        if request.page_keys is None:
            request.page_keys = self.page_keys(request.prompt, request.params.cache_salt)
        return request.page_keys

    def match(self, request: Request) -> list[int]:
        """The cached pages a waiting request would share: its longest cached run of pages, capped so that at
        least max(1, lookahead) prompt tokens are left to compute."""
        if not self.enabled:
            return []
        usable = (len(request.prompt) - max(1, self.lookahead)) // self.page_size
        return self.kv.pages.lookup(self._keys(request)[:usable])

    def fits(self, request: Request, num_tokens: int) -> bool:
        """Whether the pool has the pages (and a slot) for ``num_tokens`` positions of a waiting request."""
        return self.kv.can_allocate(num_tokens, self.match(request))

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Reserve ``num_tokens`` positions for an admitted request (its ``slot``), sharing its cached pages; it
        then prefills from the first position not cached."""
        shared = self.match(request)
        slot = request.slot = self.kv.allocate(num_tokens, shared)
        if self.enabled:
            request.num_published = len(shared)
            self.queries += len(request.prompt)
            self.hits += len(shared) * self.page_size
        if shared:
            request.num_cached = request.stats.cached_prompt_tokens = len(shared) * self.page_size
            self.worker.prefix_reused(slot, request.prompt[:request.num_cached])

    def waits_for_writer(self, request: Request, writers: list[Request]) -> bool:
        """Whether a waiting request's first page not cached is one that a request prefilling now (``writers``:
        the running and just admitted ones) will publish: it then joins once that page is written (the first
        of a burst of requests behind one new system prompt prefills it, the rest reuse it)."""
        if not self.enabled:
            return False
        usable = (len(request.prompt) - max(1, self.lookahead)) // self.page_size
        num_cached = len(self.match(request))
        if num_cached >= usable:
            return False
        key = self._keys(request)[num_cached]
        return any(w.is_context and key in w.page_keys[w.num_published:] for w in writers
                   if w.page_keys is not None)

    def publish(self, request: Request) -> None:
        """After a step that prefilled part of ``request``'s prompt has completed: cache its newly written full
        pages whose key's tokens lie in the prompt."""
        if self.enabled:
            self._publish(request, self._keys(request))

    def publish_finished(self, request: Request) -> None:
        """A request that ended with its whole text ("stop", "length"): cache the pages of its prompt and output
        whose K/V are final (written and committed, the drafter's lookahead tokens accepted too), so a next turn
        that resends the conversation reuses the answer as well."""
        if self.enabled:
            text = request.prompt + request.output
            self._publish(request, self.page_keys(text, request.params.cache_salt))

    def _publish(self, request: Request, keys: list[bytes]) -> None:
        done = min(len(keys), request.num_cached // self.page_size)
        row = self.kv.pages_of(request.slot)
        for i in range(request.num_published, done):
            self.kv.pages.publish(row[i], keys[i])
        request.num_published = max(done, request.num_published)

    def reset(self) -> None:
        """Forget every cached page (benchmarks: a cold start without a new engine). Pages in use stay with
        their requests."""
        self.kv.pages.forget()
