"""CUDA graphs for generation-only steps: one captured OneModel.forward per batch-size bucket, draft lengths
(verified, proposed: both max_draft_len unless a draft-length schedule changes them) and sampling variant
(all-greedy argmax / sampled / sampled with request seeds, and the logprobs width: none, or the top entries per
row, one of a few fixed widths; known on the host from the SamplingParams).

Inputs live in one static int64 buffer (token ids, positions, slots, drafts), refilled by a single
host-to-device copy per step; the sampling rows live in SpecMetadata's static buffers. A batch is padded
to its bucket with greedy dummy requests whose block-table row points only at the scratch page, so their
K/V writes land where nobody reads. Target verify, acceptance, sampling and all K draft passes replay as
one graph. With ``compile_step`` on a fused target, the step is compiled whole (embedding, acceptance,
sampling, draft passes fused; dynamic shapes, so one compilation serves every bucket above 1) but for the decoder
layers, which run one compiled layer each (one compilation serves all layers: ``FusedDecoder``), replayed inside
each CUDA graph. Under tensor parallelism the step's collectives trace as the layers' do; its traces are not kept
on disk there (:func:`compiled_generation_step`).
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm

from .. import trace_cache
from ..config import SamplingParams
from ..drafts.metadata import sampling_variant
from ..model.attention import AttentionMetadata
from ..model.decoder import layer_backend
from ..model.kv_cache import KVCache
from ..model.layers import COMPILE_OPTIONS
from ..one_model import OneModel
from ..sampling import flashinfer_ops
from .draft_len import DraftLenSchedule

_DUMMY = SamplingParams()  # greedy
# compile_step="auto" compiles targets with at least this many bytes of weights per GPU (see compile_pays): between
# the embedded demo (16 MB) and the smallest served LMs (Llama-3.2-1B, Qwen3-0.6B: 1.2-2.5 GB)
COMPILE_MIN_WEIGHT_BYTES = 256 * 2**20
GraphKey = tuple[int, int, int, bool, bool, int]  # bucket, draft_len, next_draft_len, *sampling_variant


def compile_pays(compile_step: bool | str, target: torch.nn.Module) -> bool:
    """``EngineConfig.compile_step`` resolved for ``target``: True / False as given; "auto" compiles a target with
    at least COMPILE_MIN_WEIGHT_BYTES of weights on this GPU.

    Compiling makes every step faster, so the rule weighs the start-up it costs. Measured on an H100
    (``scripts/benchmark.py --shape S --compare-eager --batches 1 8 --forced 3 --no-hf``, bf16, EAGLE-3 3 of 3;
    docs/benchmarks/README.md): the demo's shape (16 MB of weights) is built and captured in 1.7 s eager and
    in 36.4 s compiled, for steps of 0.74 -> 0.53 ms at batch 1 and 1.44 -> 0.68 ms at batch 8: a demo that
    should answer in seconds. The Llama-3.2-1B shape (2.5 GB) compiles in 32 s for 1.97 -> 1.70 ms (batch 1) and
    2.98 -> 2.06 ms (batch 8), and the 8B shape's steps take 23-25 % less (6.55 -> 5.03 ms, H200): models served
    for real, where a second start loads the compiled step from disk (``TLLM_SPEC_CACHE_DIR``) in seconds."""
    if isinstance(compile_step, bool):
        return compile_step
    return sum(p.numel() * p.element_size() for p in target.parameters()) >= COMPILE_MIN_WEIGHT_BYTES


def num_compiled_graphs() -> int:
    """Graphs torch.compile (Dynamo) has compiled in this process so far: after warm-up, a rise means a compile
    on a request's path."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def variant_example(variant: tuple[bool, bool, int]) -> SamplingParams:
    """A request whose batch alone has the sampling ``variant`` (:func:`sampling_variant`)."""
    all_greedy, has_request_seeds, logprobs_width = variant
    return SamplingParams(temperature=0.0 if all_greedy else 1.0, seed=0 if has_request_seeds else None,
                          logprobs=logprobs_width or None)


def variant_name(variant: tuple[bool, bool, int]) -> str:
    """"greedy", "sampled" or "seeded", with the logprobs width if any: for progress bars and reports."""
    all_greedy, has_request_seeds, logprobs_width = variant
    name = "greedy" if all_greedy else "seeded" if has_request_seeds else "sampled"
    return f"{name}+logprobs{logprobs_width}" if logprobs_width else name


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to max_batch_size (always included)."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size = size * 2 if size < 16 else size + (8 if size < 32 else 16)
    return sizes + [max_batch_size]


def advance_inputs(inputs: torch.Tensor, packed: torch.Tensor, size: int, draft_len: int, max_draft_len: int,
                   padding_slot: int) -> None:
    """The next generation step's inputs from this one's packed outputs, in place on the device: what the engine
    computes on the host after a step, for requests that all continue with ``draft_len`` drafts. inputs
    [4, T] int64 (ids | positions | slots | drafts, flat layout); packed [size, 2K+3 (+ logprob columns, not
    read)]. Each request's next tokens are its ``next_new_tokens`` (the last accepted token, then the new drafts),
    its positions move on by its accepted count, its slot stays; padding rows (``padding_slot``) keep their
    positions."""
    per_request = draft_len + 1
    tokens = size * per_request
    slots = inputs[2, :tokens].view(size, per_request)
    accepted = packed[:, max_draft_len + 1] * (slots[:, 0] != padding_slot)  # [size]
    next_tokens = packed[:, max_draft_len + 2:max_draft_len + 2 + per_request]  # [size, k+1]
    inputs[0, :tokens].view(size, per_request).copy_(next_tokens)
    inputs[1, :tokens].view(size, per_request).add_(accepted[:, None])
    inputs[3, :size * draft_len].view(size, draft_len).copy_(next_tokens[:, 1:])


def generation_step(model: OneModel, kv: KVCache, ids: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """One generation-only step, as captured: ids, positions, slots [B*(k+1)] int64 in the flat layout; drafts
    [B, k] int64 (k = spec_metadata.draft_len) -> packed outputs [B, 2K+3 (+ logprob columns)] int64."""
    model.spec_metadata.bind_generation_requests(drafts)
    attn = AttentionMetadata.build(kv, slots, positions, kv.max_pages_per_request * kv.page_size,
                                   tokens_per_request=drafts.shape[1] + 1)
    attn = model.worker.verify_metadata(attn, 0, drafts.shape[0], drafts.shape[1])  # a tree's runs: masked
    return model.packed_forward(ids, attn, drafts)


def compiled_generation_step(backend: str = "inductor", cache_traces: bool = True) -> Callable[..., torch.Tensor]:
    """:func:`generation_step` under torch.compile with dynamic shapes, the fused layers compiled with the same
    backend (:func:`tllm_spec.model.decoder.layer_backend`); call it inside :func:`step_compile_settings` (with
    the same ``cache_traces``) and inference mode. With ``cache_traces`` its traces, and the layers', are loaded
    from disk where an earlier process kept them (:mod:`tllm_spec.trace_cache`); tensor-parallel ranks do not
    cache them: every rank would write the same package at once, each guarded on its own device."""
    options = None
    if backend == "inductor":  # Inductor's coalescing analysis asserts on some of a dynamic tree's fused nodes
        from torch._inductor import config as inductor_config
        options = {**COMPILE_OPTIONS, **({"triton.coalesce_tiling_analysis": False}
                                         if hasattr(inductor_config.triton, "coalesce_tiling_analysis") else {})}
    compile_fn = trace_cache.compile if cache_traces else torch.compile
    step = compile_fn(generation_step, dynamic=True, backend=backend, options=options)

    def run(*args) -> torch.Tensor:
        with layer_backend(backend):
            return step(*args)
    return run


def step_compile_settings(cache_traces: bool = True) -> contextlib.ExitStack:
    """Dynamo settings the compiled step needs: no duck sizing (a batch of 2 must not be tied to a model's 2 KV
    heads, which would specialise it) and room for one compilation per (sampling variant, draft lengths, batch
    1 or more) the buckets capture (limits this torch version does not know are left alone); with
    ``cache_traces``, traces recorded for :func:`trace_cache.save`."""
    stack = contextlib.ExitStack()
    if cache_traces:
        stack.enter_context(trace_cache.caching())
    stack.enter_context(torch.fx.experimental._config.patch(use_duck_shape=False))
    limits = {name: value for name, value in (("recompile_limit", 64), ("accumulated_recompile_limit", 1024))
              if hasattr(torch._dynamo.config, name)}
    stack.enter_context(torch._dynamo.config.patch(**limits))
    return stack


class CUDAGraphRunner:
    """Captures lazily, on the first step of each bucket; replays afterwards. ``compile_step``: capture the
    step compiled whole (:func:`compiled_generation_step`; its traces kept on disk but for a tensor-parallel
    target) instead of eagerly traced kernels."""

    def __init__(self, model: OneModel, kv_cache: KVCache, schedule: DraftLenSchedule, max_batch_size: int,
                 compile_step: bool):
        self.model, self.kv_cache, self.schedule = model, kv_cache, schedule
        self.compile_step = compile_step
        self.cache_traces = compile_step and model.target.parallel is None
        self.step = compiled_generation_step(cache_traces=self.cache_traces) if compile_step else generation_step
        self.compile_settings = (functools.partial(step_compile_settings, self.cache_traces) if compile_step
                                 else contextlib.nullcontext)
        self.k = model.max_draft_len
        self.buckets = batch_buckets(max_batch_size)
        max_tokens = self.buckets[-1] * (self.k + 1)
        self.inputs = torch.zeros(4, max_tokens, dtype=torch.int64, device=model.device)  # ids|pos|slots|drafts
        self.host_inputs = torch.zeros(4, max_tokens, dtype=torch.int64, pin_memory=model.device.type == "cuda")
        # (bucket, draft_len, next_draft_len, all_greedy, has_request_seeds, logprobs_width) -> (graph, packed)
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.last: tuple[GraphKey, int] | None = None  # graph key, requests of the last run
        self.capture_seconds: dict[GraphKey, float] = {}  # wall time of each capture, its compile included

    def bucket(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    @torch.inference_mode()
    def capture_all(self, params: Sequence[SamplingParams] = (_DUMMY,), progress: bool = True) -> None:
        """Capture every bucket now (on all-padding inputs) in each sampling variant a batch of ``params``
        can take and each draft length the schedule gives its batch sizes, so no steady step later pays for a
        capture (a step where the schedule changes the draft length captures its graph on first use). The first
        capture also pays for torch.compile (Inductor's on-disk cache makes a second start quick). A batch
        mixing requests may have a variant none of them has alone (a sampled one beside a greedy one asking for
        logprobs): that one is captured on first use."""
        todo = self.missing(params)
        bar = tqdm(todo, desc="compile + capture CUDA graphs", unit="graph", disable=not progress or not todo)
        for size, k, variant, example in bar:
            if not any(variant[:2]) and self.model.worker.use_flashinfer and flashinfer_ops.sampling_build_running():
                bar.set_postfix_str("waiting for FlashInfer's sampling JIT build")
                flashinfer_ops.wait_sampling_build()
            bar.set_postfix_str(f"batch {size}, {k} drafts, {variant_name(variant)}")
            self._fill([], [], [], [], [], size, k, k, pad_params=example)
            self._capture_into((size, k, k, *variant))
        if todo:
            self._keep_traces()

    def missing(self, params: Sequence[SamplingParams]) -> list[tuple[int, int, tuple, SamplingParams]]:
        """(bucket, draft length, variant, example params) of each graph :meth:`capture_all` would capture for
        ``params``; greedy first: FlashInfer's JIT build, started with the runner
        (flashinfer_ops.start_sampling_build), goes on beside those."""
        examples = {sampling_variant([p]): p for p in params}
        pairs = self._bucket_draft_lens()
        return [(size, k, variant, example) for variant, example in sorted(examples.items(), reverse=True)
                for size, k in pairs if (size, k, k, *variant) not in self.graphs]

    def _bucket_draft_lens(self) -> list[tuple[int, int]]:
        """(bucket, draft length) for every draft length the schedule gives a batch size in the bucket."""
        pairs, low = [], 1
        for size in self.buckets:
            pairs += [(size, k) for k in sorted({self.schedule.draft_len_for(b) for b in range(low, size + 1)})]
            low = size + 1
        return pairs

    def run(self, ids: list[int], positions: list[int], slots: list[int], drafts: list[int],
            params: list[SamplingParams], draft_len: int, next_draft_len: int) -> torch.Tensor:
        """One generation-only step (``draft_len`` drafts verified per request, ``next_draft_len`` proposed);
        returns the packed outputs [B, 2K+3 (+ logprob columns)] of the real requests."""
        size = self.bucket(len(params))
        variant = sampling_variant(params)
        key = (size, draft_len, next_draft_len, *variant)
        if key not in self.graphs:  # e.g. a step that changes the draft length: capture it first ...
            self._fill([], [], [], [], [], size, draft_len, next_draft_len, pad_params=variant_example(variant))
            self._capture_into(key)  # ... on padding rows, so the warm-up steps move no
            # real request's state (its draft distributions, its thinking state), then replay on the real rows
            self._keep_traces()
        self._fill(ids, positions, slots, drafts, params, size, draft_len, next_draft_len)
        graph, packed = self.graphs[key]
        graph.replay()
        self.last = (key, len(params))
        return packed[:len(params)]

    def can_run_next(self) -> bool:
        """Whether :meth:`run_next` may follow the last step: it verifies as many drafts as it proposed."""
        return self.last is not None and self.last[0][1] == self.last[0][2]

    def run_next(self) -> torch.Tensor:
        """Replay the last step's graph on the inputs it advanced from its own outputs (:func:`advance_inputs`),
        before the host has seen them: the same requests, sampling rows and draft lengths. Returns the packed
        outputs [B, C] of the real requests (the same buffer as the last step's: copy those out first)."""
        key, num_requests = self.last
        graph, packed = self.graphs[key]
        graph.replay()
        return packed[:num_requests]

    def _fill(self, ids: list[int], positions: list[int], slots: list[int], drafts: list[int],
              params: list[SamplingParams], size: int, draft_len: int, next_draft_len: int,
              pad_params: SamplingParams = _DUMMY) -> None:
        """Copy one step's inputs, padded to ``size`` requests (``pad_params``: greedy by default), into the
        static buffers."""
        pad, per_request = size - len(params), draft_len + 1
        tokens = size * per_request
        pad_slot = self.kv_cache.padding_slot
        rows = (ids + [0] * (pad * per_request), positions + list(range(per_request)) * pad,
                slots + [pad_slot] * (pad * per_request), drafts + [0] * (pad * draft_len + size))
        self.host_inputs[:, :tokens] = torch.tensor(rows, dtype=torch.int64)
        self.inputs[:, :tokens].copy_(self.host_inputs[:, :tokens], non_blocking=True)
        self.model.spec_metadata.prepare(params + [pad_params] * pad, (), draft_len, next_draft_len)

    def _forward(self, size: int, draft_len: int) -> torch.Tensor:
        """The step as captured: it ends by advancing its own inputs (:func:`advance_inputs`), ready for a
        :meth:`run_next`; a step the host fills overwrites them all first."""
        tokens = size * (draft_len + 1)
        drafts = self.inputs[3, :size * draft_len].view(size, draft_len)
        with self.compile_settings():
            packed = self.step(self.model, self.kv_cache, self.inputs[0, :tokens], self.inputs[1, :tokens],
                               self.inputs[2, :tokens], drafts)
        advance_inputs(self.inputs, packed, size, draft_len, self.k, self.kv_cache.padding_slot)
        return packed

    def _keep_traces(self) -> None:
        """After captures: the compiled step's traces to disk, for the next process (:mod:`tllm_spec.trace_cache`)."""
        if self.cache_traces:
            trace_cache.save()

    def _capture_into(self, key: GraphKey) -> None:
        """Capture the graph of ``key`` (its inputs already filled) and time it."""
        began = time.perf_counter()
        self.graphs[key] = self._capture(key[0], key[1])
        self.capture_seconds[key] = time.perf_counter() - began

    def _capture(self, size: int, draft_len: int) -> tuple[torch.cuda.CUDAGraph | EagerReplay, torch.Tensor]:
        """Warm up (JIT compiles, allocator) on a side stream, then capture; the RNG state is restored so
        warm-up and capture draw no numbers the caller would see. Off CUDA (tests of the runner's bookkeeping on
        the CPU) a replay runs the step eagerly into a static output."""
        seed = self.model.spec_metadata.seed.clone()
        # the graph keeps the KV tensors bound now: this engine's, whoever bound theirs since (two engines over one
        # target, as a benchmark's plain and speculative ones, each capture over their own pool)
        self.model.bind_kv_cache(self.kv_cache)
        if self.model.device.type != "cuda":
            replay = EagerReplay(lambda: self._forward(size, draft_len))
            self.model.spec_metadata.seed.copy_(seed)
            return replay, replay.out
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(size, draft_len)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            packed = self._forward(size, draft_len)
        self.pool = graph.pool()
        self.model.spec_metadata.seed.copy_(seed)
        return graph, packed


class EagerReplay:
    """A stand-in for a captured graph off CUDA: ``replay`` runs ``step`` and writes its result into the same
    output tensor (``out``) every time, as a graph replay does."""

    def __init__(self, step: Callable[[], torch.Tensor]):
        self.step = step
        self.out = step()

    def replay(self) -> None:
        self.out.copy_(self.step())

    def reset(self) -> None:
        """Nothing to release (:meth:`torch.cuda.CUDAGraph.reset`'s counterpart)."""
