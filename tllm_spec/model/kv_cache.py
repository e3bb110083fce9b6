"""Paged KV pool for the target's and the draft's layers: block tables and pages, one shared allocator."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..kernels.kv_write import flat_slot_index
from ..kernels.move_rows import cache_table
from .page_pool import PagePool

SCRATCH_PAGE = 0  # never handed out: unused block-table entries (and padding rows) point here


class KVCache:
    """K/V pages for every attention layer (target layers first, then the draft's), one block table row per
    request slot. Rewinding rejected drafts is a length change done by the engine: nothing is copied.

    k[layer], v[layer]: [num_pages, page_size, num_kv_heads, head_dim]; block_tables [max_requests,
    max_pages_per_request] int32 on the device. :meth:`allocate` and :meth:`free` change rows on the host; the
    device table takes every row changed since its last read in one copy when it is next read (``block_tables``),
    or at :meth:`flush`: a serving engine that frees and admits dozens of requests between two steps makes a few
    device calls instead of several per request (each call lets the server's threads take the interpreter).

    Prefix caching shares pages between rows: ``pages`` (:class:`PagePool`) counts each page's holders and keeps
    released pages that hold a cached prefix evictable; a row's shared pages are only ever read.

    ``dtype`` FP8 (``EngineConfig.kv_cache_dtype="fp8"``): pages of E4M3 values, each layer's K and V with one
    per-tensor scale (``kv_scales``: the checkpoint's, else 1.0 as vLLM does): twice the tokens in the same bytes.
    """

    def __init__(self, layer_shapes: list[tuple[int, int]], num_pages: int, page_size: int, max_requests: int,
                 max_tokens_per_request: int, dtype: torch.dtype, device: torch.device | str,
                 kv_scales: Sequence[tuple[float, float]] | None = None):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is scratch), got {num_pages}")
        self.page_size = page_size
        self.max_pages_per_request = math.ceil(max_tokens_per_request / page_size)
        self.k = [torch.zeros(num_pages, page_size, h, d, dtype=dtype, device=device) for h, d in layer_shapes]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.kv_scales = [(1.0, 1.0)] * len(layer_shapes)
        if kv_scales is not None:  # the target's layers first; the draft's keep 1.0
            self.kv_scales[:len(kv_scales)] = [(float(k), float(v)) for k, v in kv_scales]
        groups: dict[tuple[int, int], list[torch.Tensor]] = {}
        for cache in self.k + self.v:
            groups.setdefault(tuple(cache.shape[2:]), []).append(cache)
        # every K and V cache, grouped by row shape, with their device address table (kernels.move_rows)
        self.row_groups = [(caches, cache_table(caches)) for caches in groups.values()]
        # one extra row, never allocated: the slot of CUDA-graph padding rows (all scratch)
        self._block_tables = torch.full((max_requests + 1, self.max_pages_per_request), SCRATCH_PAGE,
                                        dtype=torch.int32, device=device)
        self._changed: dict[int, list[int]] = {}  # slot -> its pages, not yet written to the device table
        self.padding_slot = max_requests
        self.pages = PagePool(num_pages, first=SCRATCH_PAGE + 1)
        self._free_slots = list(range(max_requests - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    def scales(self, layer: int) -> tuple[float, float]:
        """(k_scale, v_scale) of KV layer ``layer`` (1.0 each but in an FP8 cache with checkpoint scales)."""
        return self.kv_scales[layer]

    @property
    def block_tables(self) -> torch.Tensor:
        """The device block table, with every row changed on the host written first (:meth:`flush`)."""
        self.flush()
        return self._block_tables

    def flush(self) -> None:
        """Write the rows :meth:`allocate` and :meth:`free` changed into the device table: one host-to-device copy,
        stream-ordered (a step in flight keeps reading the rows it was launched with)."""
        if not self._changed:
            return
        width = self.max_pages_per_request
        slots, rows = list(self._changed), [p + [SCRATCH_PAGE] * (width - len(p)) for p in self._changed.values()]
        self._changed = {}
        changed = torch.tensor([slots, *zip(*rows)], dtype=torch.int32)  # [1 + width, n]: one copy
        changed = changed.to(self._block_tables.device, non_blocking=True)
        self._block_tables.index_copy_(0, changed[0].long(), changed[1:].t())

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take now: free, and evictable cached pages (:class:`PagePool`)."""
        return self.pages.num_available

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def can_allocate(self, num_tokens: int, shared: Sequence[int] = ()) -> bool:
        return bool(self._free_slots) and self.pages.can_take(self.pages_for(num_tokens) - len(shared), shared)

    def allocate(self, num_tokens: int, shared: Sequence[int] = ()) -> int:
        """Reserve pages for ``num_tokens`` positions, the first ``len(shared)`` of them the cached pages
        ``shared`` (a reused prefix: read, never written); returns the request's slot (its block-table row)."""
        num = self.pages_for(num_tokens)
        if num > self.max_pages_per_request:
            raise ValueError(f"{num_tokens} tokens exceed a request's block table ({self.max_pages_per_request} "
                             f"pages of {self.page_size})")
        if not self.can_allocate(num_tokens, shared):
            raise RuntimeError(f"KV pool exhausted: {num - len(shared)} pages wanted, {self.num_free_pages} free")
        slot = self._free_slots.pop()
        self._pages[slot] = self._changed[slot] = list(shared) + self.pages.take(num - len(shared), shared)
        return slot

    def free(self, slot: int) -> None:
        """Return a finished request's slot, and its holds on its pages, to the pool."""
        self.pages.release(self._pages.pop(slot))
        self._free_slots.append(slot)
        self._changed[slot] = []

    def pages_of(self, slot: int) -> list[int]:
        """A request's block-table row (its pages, first position first)."""
        return self._pages[slot]

    def write_index(self, token_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat index (page * page_size + offset) of each token's K/V. [N] int64 -> [N] int64, on device."""
        return flat_slot_index(self.block_tables, token_slots, positions, self.page_size)

    def gather_request(self, layer: int, slot: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one request's first ``num_tokens`` positions, [num_tokens, Hkv, D] each (tests, debugging)."""
        pages = torch.tensor(self._pages[slot], device=self.block_tables.device)
        k = self.k[layer][pages].flatten(0, 1)[:num_tokens]
        v = self.v[layer][pages].flatten(0, 1)[:num_tokens]
        return k, v
