"""Attention alone at the verify shape of a long-context step: our paged-attention kernel unsplit (``old``) and
split over the KV (``split``), FlashInfer's paged prefill wrapper (``flashinfer``) and its XQA decode kernel
(``xqa``), all over one paged cache.

Shape: B requests of K+1 = 4 query tokens at positions context..context+3 (the cache holds context + 4 tokens a
request, in pages of 16 scattered over the pool), 32 query heads, 8 KV heads, head_dim 128, bf16. Each backend is
timed over CUDA-graph replays (CUDA events on eager calls where capture fails; wall clock on the CPU), the calls
taking several copies of the cache in turn so that a small cache is read from HBM, not from L2. A backend that is
missing or fails is recorded with the reason instead of a time.
"""
from __future__ import annotations

import importlib
import inspect
import math
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..kernels.paged_attention import paged_attention, paged_attention_ref
from ..sampling.flashinfer_ops import load_flashinfer

BACKENDS = ("old", "split", "flashinfer", "xqa")
_UNCACHED_BYTES = 256 * 2**20  # the copies timed in turn hold at least this much (an H100's L2 is 50 MB)
_MAX_COPIES = 32
_WORKSPACE_BYTES = 256 * 2**20  # FlashInfer's float workspace (128 MB recommended)
_XQA_WORKSPACE_BYTES = 512 * 2**20  # 8 MB of semaphores, then scratch for the multi-block partials
_REASON_CHARS = 600

Run = Callable[[int], torch.Tensor]  # copy index -> output [B*Q, Hq, D]


class Unavailable(Exception):
    """A backend this environment does not have (the message says why)."""


@dataclass(frozen=True)
class VerifyShape:
    """One verify call: ``batch`` requests of ``query_len`` query tokens after ``context`` cached tokens."""

    batch: int
    context: int
    query_len: int = 4
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype_bytes: int = 2  # bf16 (1: an FP8 cache)

    @property
    def kv_len(self) -> int:
        return self.context + self.query_len

    @property
    def pages_per_request(self) -> int:
        return -(-self.kv_len // self.page_size)

    @property
    def kv_bytes(self) -> int:
        """K and V one call must read: every request's kv_len tokens, once for its query_len tokens."""
        return int(kv_bytes_read(self.batch, self.kv_len, 1, self.num_kv_heads, self.head_dim, self.dtype_bytes))


def kv_bytes_read(batch: int, context: float, num_layers: int, num_kv_heads: int, head_dim: int,
                  dtype_bytes: int) -> float:
    """batch x context x 2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
    return batch * context * 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass
class VerifyInputs:
    q: torch.Tensor  # [B*Q, Hq, D] bf16
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # copies of (k, v), each [num_pages, page_size, Hkv, D] bf16
    block_tables: torch.Tensor  # [B, pages_per_request] int32, pages in random order
    token_slots: torch.Tensor  # [B*Q] int64: request b's rows are b
    positions: torch.Tensor  # [B*Q] int64: context .. context+Q-1 in each request
    scale: float


def copies_for(shape: VerifyShape) -> int:
    """Copies of the cache the timed calls take in turn: together at least _UNCACHED_BYTES (at most 32)."""
    return max(1, min(_MAX_COPIES, math.ceil(_UNCACHED_BYTES / shape.kv_bytes)))


def make_inputs(shape: VerifyShape, device: torch.device, copies: int, seed: int = 0) -> VerifyInputs:
    """Random q and caches (``copies`` of them, one block table: each request's pages in random order)."""
    torch.manual_seed(seed)
    b, n, dt = shape.batch, shape.query_len, torch.bfloat16
    num_pages = b * shape.pages_per_request
    cache_shape = (num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim)
    cache_dt = torch.float8_e4m3fn if shape.dtype_bytes == 1 else dt  # an FP8 cache: one byte per element
    caches = [(torch.randn(cache_shape, device=device, dtype=dt).to(cache_dt),
               torch.randn(cache_shape, device=device, dtype=dt).to(cache_dt)) for _ in range(copies)]
    block_tables = torch.randperm(num_pages, device=device).to(torch.int32).view(b, shape.pages_per_request)
    return VerifyInputs(torch.randn(b * n, shape.num_q_heads, shape.head_dim, device=device, dtype=dt), caches,
                        block_tables, torch.arange(b, device=device).repeat_interleave(n),
                        (shape.context + torch.arange(n, device=device)).repeat(b), shape.head_dim ** -0.5)


def xqa_causal_mask(batch: int, query_len: int, device: torch.device | str) -> torch.Tensor:
    """XQA's bit-packed draft mask: row i may see draft tokens 0..i (bit j of 32-bit word j // 32), as uint16
    pairs (little-endian words). -> [batch, query_len, 2 * ceil(query_len / 32)] uint16."""
    words = -(-query_len // 32)
    cols = torch.arange(32 * words, device=device)
    visible = cols[None, :] <= torch.arange(query_len, device=device)[:, None]  # [Q, 32 * words]
    bits = (visible.view(query_len, words, 32).long() << torch.arange(32, device=device)).sum(-1)  # [Q, words]
    packed = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)  # the same 32 bits as an int32
    return packed.expand(batch, query_len, words).contiguous().view(torch.uint16)


def paged_run(shape: VerifyShape, inputs: VerifyInputs, num_splits: int | None,
              tile: tuple[int, int] | None = None, program_rows: int | None = None, tree: bool = False) -> Run:
    """Our kernel; ``num_splits`` 1 = unsplit, None = its automatic split-KV choice; ``tile`` (keys per iteration,
    warps) and ``program_rows`` (query rows per program at most), None = its own choice; ``tree``: through the
    draft-tree path, with a mask that hides nothing (a tree's cost, a chain's result)."""
    kwargs = {}
    if tree:
        kwargs["tree_mask"] = torch.full_like(inputs.positions, (1 << 62) - 1)
    for name, value in (("tile", tile), ("program_rows", program_rows)):
        if value is not None:
            if name not in inspect.signature(paged_attention).parameters:
                raise Unavailable(f"paged_attention has no {name} keyword in this tree")
            kwargs[name] = value
    if "num_splits" in inspect.signature(paged_attention).parameters:
        kwargs["num_splits"] = num_splits
    elif num_splits != 1:
        raise Unavailable("paged_attention has no num_splits keyword in this tree (no split-KV path)")

    def run(i: int) -> torch.Tensor:
        k, v = inputs.caches[i]
        return paged_attention(inputs.q, k, v, inputs.block_tables, inputs.token_slots, inputs.positions,
                               inputs.scale, shape.kv_len, None, shape.query_len, **kwargs)
    return run


def _flashinfer(device: torch.device) -> types.ModuleType:
    if device.type != "cuda":
        raise Unavailable("FlashInfer needs a CUDA device")
    fi = load_flashinfer()
    if fi is None:
        raise Unavailable("flashinfer is not installed or older than 0.7")
    return fi


def flashinfer_prefill_run(shape: VerifyShape, inputs: VerifyInputs) -> Run:
    """BatchPrefillWithPagedKVCacheWrapper, NHD layout (= ours), causal (queries aligned to the end of the KV);
    plan() here, outside the timed calls. FlashInfer's own choice of kernel first (FA3 on Hopper), its FA2 kernel
    where that one does not build; the run's ``backend`` attribute names the one timed."""
    device = inputs.q.device
    fi = _flashinfer(device)
    b, pages, i32 = shape.batch, shape.pages_per_request, torch.int32
    failures = []
    for backend in ("auto", "fa2"):
        try:
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device), "NHD", backend=backend)
            wrapper.plan(torch.arange(b + 1, dtype=i32, device=device) * shape.query_len,  # qo_indptr
                         torch.arange(b + 1, dtype=i32, device=device) * pages,  # kv_indptr
                         inputs.block_tables.flatten(),  # kv_indices
                         torch.full((b,), shape.kv_len - (pages - 1) * shape.page_size, dtype=i32, device=device),
                         shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.page_size, causal=True,
                         sm_scale=inputs.scale, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        except (RuntimeError, TypeError) as err:  # a JIT build that fails (headers a trimmed install lacks), an
            failures.append(f"{backend}: {_reason(err)}")  # older wrapper without the keyword
            continue

        def run(i: int, wrapper=wrapper) -> torch.Tensor:
            return wrapper.run(inputs.q, inputs.caches[i])
        run.backend = getattr(wrapper, "_backend", backend)  # "auto" resolved by plan() where the wrapper says
        return run
    raise Unavailable("; ".join(failures))


def xqa_run(shape: VerifyShape, inputs: VerifyInputs) -> Run:
    """flashinfer.decode.trtllm_batch_decode_with_kv_cache(backend="xqa", q_len_per_req=Q) with a causal mask."""
    device = inputs.q.device
    _flashinfer(device)
    fn = getattr(importlib.import_module("flashinfer.decode"), "trtllm_batch_decode_with_kv_cache", None)
    params = inspect.signature(fn).parameters if fn is not None else {}
    if "q_len_per_req" not in params:
        raise Unavailable("flashinfer.decode.trtllm_batch_decode_with_kv_cache(q_len_per_req=) is not in this "
                          "flashinfer")
    workspace = torch.zeros(_XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # semaphores start at 0
    seq_lens = torch.full((shape.batch,), shape.kv_len, dtype=torch.int32, device=device)
    kwargs = {"bmm1_scale": inputs.scale, "bmm2_scale": 1.0, "kv_layout": "NHD", "backend": "xqa",
              "q_len_per_req": shape.query_len}
    if "mask" in params:
        kwargs["mask"] = xqa_causal_mask(shape.batch, shape.query_len, device)
    return lambda i: fn(inputs.q, inputs.caches[i], workspace, inputs.block_tables, seq_lens, shape.kv_len,
                        **kwargs)


def backend_run(name: str, shape: VerifyShape, inputs: VerifyInputs) -> Run:
    if name == "old":
        return paged_run(shape, inputs, 1)
    if name == "split":
        return paged_run(shape, inputs, None)
    if name == "flashinfer":
        return flashinfer_prefill_run(shape, inputs)
    if name == "xqa":
        return xqa_run(shape, inputs)
    raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")


def time_per_call_us(run: Run, copies: int, device: torch.device, iters: int = 50, repeats: int = 5
                     ) -> tuple[float, str]:
    """(microseconds per call, how it was timed). The calls take the copies in turn."""
    for i in range(3):
        run(i % copies)
    if device.type != "cuda":
        start = time.perf_counter()
        for i in range(iters):
            run(i % copies)
        return (time.perf_counter() - start) * 1e6 / iters, "wall clock"
    torch.cuda.synchronize(device)
    replay, method = _captured(run, copies, iters)
    replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (repeats * iters), method


def _captured(run: Run, copies: int, iters: int) -> tuple[Callable[[], object], str]:
    """``iters`` calls captured in one CUDA graph, or replayed eagerly where capture fails."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(iters):
                run(i % copies)
        return graph.replay, "cuda graph"
    except Exception:  # e.g. a call that synchronises or plans on the host
        torch.cuda.synchronize()
        return (lambda: [run(i % copies) for i in range(iters)]), "cuda events"


def _reason(err: BaseException) -> str:
    """One line: the error's start and, for a long one (a build log), its end, where the cause is."""
    text = " ".join((str(err) if isinstance(err, Unavailable) else f"{type(err).__name__}: {err}").split())
    return text if len(text) <= _REASON_CHARS else f"{text[:_REASON_CHARS // 3]} ... {text[-2 * _REASON_CHARS // 3:]}"


def _entry(name: str, shape: VerifyShape, unavailable: str | None = None) -> dict:
    return {"backend": name, "batch": shape.batch, "context": shape.context, "query_len": shape.query_len,
            "kv_bytes": shape.kv_bytes, "us_per_call": None, "roofline_fraction": None, "timing": None,
            "max_abs_error": None, "kernel": None, "unavailable": unavailable}


def attention_entry(name: str, shape: VerifyShape, inputs: VerifyInputs, bandwidth: float, iters: int,
                    reference: torch.Tensor | None) -> dict:
    """One backend at one shape: time, share of the bandwidth, error against ``reference`` (when given), or why
    it is unavailable."""
    entry = _entry(name, shape)
    try:
        run = backend_run(name, shape, inputs)
        if reference is not None:
            entry["max_abs_error"] = (run(0).float() - reference.float()).abs().max().item()
        us, entry["timing"] = time_per_call_us(run, len(inputs.caches), inputs.q.device, iters)
        entry["kernel"] = getattr(run, "backend", None)  # which of a backend's kernels ran (FlashInfer's)
    except Exception as err:  # missing API, unsupported shape, JIT failure, out of memory: recorded, not fatal
        entry["unavailable"] = _reason(err)
        return entry
    entry["us_per_call"] = us
    entry["roofline_fraction"] = shape.kv_bytes / (us * 1e-6) / bandwidth
    return entry


def attention_entries(backends: list[str], batches: list[int], contexts: list[int], bandwidth: float,
                      device: torch.device, iters: int = 50) -> Iterator[dict]:
    """Every backend at every (batch, context); outputs are checked against paged_attention_ref on the first."""
    first = True
    for batch in batches:
        for context in contexts:
            shape = VerifyShape(batch, context)
            try:
                inputs = make_inputs(shape, device, copies_for(shape))
            except torch.cuda.OutOfMemoryError as err:
                yield from (_entry(name, shape, _reason(err)) for name in backends)
                continue
            reference = paged_attention_ref(inputs.q, *inputs.caches[0], inputs.block_tables, inputs.token_slots,
                                            inputs.positions, inputs.scale, shape.kv_len, None,
                                            shape.query_len) if first else None
            for name in backends:
                yield attention_entry(name, shape, inputs, bandwidth, iters, reference)
            first = False
            del inputs, reference
            if device.type == "cuda":
                torch.cuda.empty_cache()
