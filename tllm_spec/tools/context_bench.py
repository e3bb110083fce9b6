"""Long-context decoding: the graphed step's time against the memory roofline, prefill speed and time to first
token, per batch size, context length and mode (no speculation; EAGLE-3 with acceptance forced), on
random-weight models of a named shape.

One KV pool serves every point: sized for the largest point whose KV fits in ``kv_cache_fraction`` of the memory
left after the target's weights; the others are skipped with the reason. The modes run one after the other on
the same target (each model's pool is freed before the next is built), so the largest point needs one pool;
the roofline bytes are benchmark.step_bytes' (target weights once, draft weights and the draft layer's KV per
draft pass, the target layers' KV).

A point adds its prompts to the engine in groups of at most ``max_prefill_tokens`` (a whole batch of long
prompts in one prefill step would not fit beside the pool), then times decode steps of the full batch as
``generate`` does (the engine's decode timer: graphed steps, each run ahead of the host's work on the last).
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from ..config import Eagle3Config, EngineConfig, SamplingParams
from ..engine.engine import Engine
from ..engine.request import DecodeTimer, StreamOutput
from ..model.target import TargetModel
from ..sampling import flashinfer_ops
from ..spec_model import SpecModel
from .attention_bench import kv_bytes_read
from .benchmark import force_acceptance, step_bytes
from .random_models import DRAFT_VOCAB_SIZE, SHAPES, save_random_head

GIB = 2**30
DEFAULT_CHUNK = EngineConfig.model_fields["max_num_batched_tokens"].default  # prompt tokens a step prefills
PAGE_SIZE = 16
MODES = ("none", "eagle3")  # no speculation first: it runs before EAGLE-3 makes the shared target capture layers


@dataclass
class ContextPoint:
    """One measured (batch, context, mode)."""

    batch: int
    context: int  # prompt tokens of each request
    mode: str  # "none" or "eagle3"
    forced_drafts: float | None  # forced accepted drafts per step (None: no speculation)
    draft_len: int
    step_ms: float  # decode step of the full batch, graphed
    decode_steps: int
    mean_decode_batch: float
    mean_context: float  # KV tokens a request holds, mean over the timed steps (the prompt and what it generated)
    roofline_bytes_per_step: float  # weights + KV a step must read (benchmark.step_bytes at mean_context)
    roofline_fraction: float
    ttft_s: float  # the prefill steps of the batch's prompts, synchronised
    prefill_steps: int
    prefill_tokens_per_second: float
    peak_memory_gib: float
    skipped: str | None = None


def skipped_point(batch: int, context: int, mode: str, forced: float | None, reason: str) -> dict:
    """A point that was not measured, with the fields of a measured one set to None."""
    row = {name: None for name in ContextPoint.__dataclass_fields__}
    return {**row, "batch": batch, "context": context, "mode": mode, "forced_drafts": forced, "skipped": reason}


def roofline_fraction(bytes_per_step: float, bandwidth: float, step_ms: float) -> float:
    """Share of the memory roofline a step reaches: bytes it must read / bandwidth / its time."""
    return bytes_per_step / bandwidth / (step_ms / 1e3)


def kv_bytes_per_token(config: PretrainedConfig, draft_layers: int = 1, dtype_bytes: int = 2) -> int:
    """K and V of one token over the target's layers and ``draft_layers`` draft layers of the same shape."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(kv_bytes_read(1, 1, config.num_hidden_layers + draft_layers, config.num_key_value_heads, head_dim,
                             dtype_bytes))


def prefill_groups(batch: int, context: int, max_prefill_tokens: int) -> list[range]:
    """Request indices prefilled together: as many whole prompts as fit in max_prefill_tokens (at least one)."""
    size = max(1, max_prefill_tokens // context)
    return [range(i, min(i + size, batch)) for i in range(0, batch, size)]


def max_new_tokens(batch: int, context: int, new_tokens: int, k: int, max_prefill_tokens: int,
                   chunk: int = DEFAULT_CHUNK) -> int:
    """What a request may generate: the timed ``new_tokens`` after what it decodes while later prompts prefill
    (up to K+1 tokens in each prefill step: a step per ``chunk`` prompt tokens of the batch, and one more per
    group), with ``new_tokens`` of room besides."""
    prefill_steps = -(-batch * context // chunk) + len(prefill_groups(batch, context, max_prefill_tokens))
    return 2 * new_tokens + prefill_steps * (k + 1)


@dataclass(frozen=True)
class ContextPlan:
    """The KV pool and sequence bound of the points that fit; ``skipped``: (batch, context) -> why not."""

    num_pages: int
    max_seq_len: int
    budget_bytes: float
    skipped: dict[tuple[int, int], str]


def plan_points(batches: list[int], contexts: list[int], new_tokens: int, k: int, bytes_per_token: int,
                budget_bytes: float, max_prefill_tokens: int, page_size: int = PAGE_SIZE) -> ContextPlan:
    """Pages each point needs (every request's prompt, new tokens and the 2K + 1 positions a step may write past
    them, plus the scratch page) against the budget; the pool fits the largest point that fits."""
    num_pages, max_seq_len, skipped = 2, 8, {}
    for batch in batches:
        for context in contexts:
            total = context + max_new_tokens(batch, context, new_tokens, k, max_prefill_tokens)
            pages = batch * math.ceil((total + 2 * k + 1) / page_size) + 1
            need = pages * page_size * bytes_per_token
            if need > budget_bytes:
                skipped[(batch, context)] = (f"KV of batch {batch} x {total} tokens needs {need / GIB:.1f} GiB; the "
                                             f"pool may take {budget_bytes / GIB:.1f} GiB")
                continue
            num_pages, max_seq_len = max(num_pages, pages), max(max_seq_len, total)
    return ContextPlan(num_pages, max_seq_len, budget_bytes, skipped)


@dataclass
class _Drive:
    """A run of the engine driven from this thread (:func:`_driven`)."""

    ramping: bool = True  # each step alone: none launched ahead of the host's work
    stop_at: int = 0  # after the ramp: no step launched ahead once the engine's timer holds this many steps
    tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens it has produced so far


@contextlib.contextmanager
def _driven(engine: Engine) -> Iterator[_Drive]:
    """Take over ``engine``'s output callback and its ``should_yield`` (stop running ahead) for a :class:`_Drive`,
    with the admission delays off (a group joins at its first step: a delay would time the running requests' decode
    steps as the group's prefill, and let them finish before the batch is full); on the way out, requests left are
    aborted and all three are given back."""
    admission = engine.admission
    saved = engine.on_output, engine.should_yield, admission.delay_factor, admission.window
    admission.delay_factor = admission.window = 0.0
    drive = _Drive()

    def on_output(out: StreamOutput) -> None:
        drive.tokens[out.request_id] = drive.tokens.get(out.request_id, 0) + len(out.token_ids)

    engine.on_output = on_output
    engine.should_yield = lambda: drive.ramping or engine.timer.steps >= drive.stop_at
    try:
        yield drive
    finally:
        for r in [*engine.waiting, *engine.running]:
            engine.abort(r.request_id)
        with contextlib.suppress(Exception):
            while engine.num_requests:  # an aborted running request leaves at the end of one more step
                engine.step()
        engine.on_output, engine.should_yield, admission.delay_factor, admission.window = saved


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_context_point(model: SpecModel, batch: int, context: int, new_tokens: int, forced: float | None,
                          bandwidth: float, max_prefill_tokens: int, seed: int = 0) -> ContextPoint:
    """Prefill ``batch`` random prompts of ``context`` tokens group by group (timed: TTFT), then time
    new_tokens / (K+1) decode steps of the full batch (fewer if a request ends first). The engine is driven from
    the calling thread: the model's engine thread must be idle (no ``generate`` running)."""
    force_acceptance(model, forced)
    flashinfer_ops.wait_sampling_build()  # no timing shares the host with FlashInfer's JIT build
    engine, device, k = model.engine, model.device, model.max_draft_len
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.target.vocab_size, (context,), generator=gen).tolist() for _ in range(batch)]
    params = SamplingParams(max_new_tokens=max_new_tokens(batch, context, new_tokens, k, max_prefill_tokens,
                                                          engine.max_num_batched_tokens), ignore_eos=True)
    _check_room(model, batch, context, params)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode(), _driven(engine) as drive:
        ttft, prefill_steps = 0.0, 0
        for group in prefill_groups(batch, context, max_prefill_tokens):
            ids = {engine.add(i, prompts[i], params, f"context-{seed}-{i}") for i in group}
            _sync(device)
            start = time.perf_counter()
            while not ids <= drive.tokens.keys():  # until each has its first token
                engine.step()
                prefill_steps += 1
            _sync(device)
            ttft += time.perf_counter() - start
        drive.ramping, before, generated = False, DecodeTimer(**vars(engine.timer)), sum(drive.tokens.values())
        drive.stop_at = before.steps + max(1, new_tokens // (k + 1))
        while engine.num_requests == batch and engine.timer.steps < drive.stop_at:
            engine.step()
        timed = engine.timer.minus(before)
        generated += sum(drive.tokens.values())  # before + after the timed steps
    if not timed.steps:
        raise ValueError(f"no decode step of the full batch was timed (new_tokens {new_tokens} too few?)")
    step_ms = 1e3 * timed.seconds / timed.steps
    draft_len = model.runner.draft_len_for(batch)
    mean_context = context + generated / (2 * batch)  # the KV a timed step reads, on average
    nbytes = step_bytes(model, batch, mean_context, draft_len)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
    return ContextPoint(batch, context, "eagle3" if k else "none", forced, draft_len, step_ms, timed.steps,
                        timed.request_steps / timed.steps, mean_context, nbytes,
                        roofline_fraction(nbytes, bandwidth, step_ms), ttft, prefill_steps, batch * context / ttft,
                        peak)


def _check_room(model: SpecModel, batch: int, context: int, params: SamplingParams) -> None:
    """The request is valid and the pool holds the whole batch at once (else the ramp would wait forever)."""
    engine, kv = model.engine, model.runner.kv_cache
    if error := engine.check([0] * context, params):
        raise ValueError(error)
    # what the engine reserves: prompt + new tokens and the 2K + 1 positions a step may write past them
    pages = kv.pages_for(min(context + params.max_new_tokens, engine.max_seq_len) + 2 * model.max_draft_len + 1)
    if engine.num_requests or batch * pages > kv.num_free_pages or batch > kv.num_free_slots:
        raise ValueError(f"the KV pool cannot hold {batch} requests of {pages} pages ({kv.num_free_pages} pages "
                         f"and {kv.num_free_slots} slots free, {engine.num_requests} requests running)")


def random_target(shape: str, device: str = "cuda", seed: int = 0) -> TargetModel:
    """A bf16 random-weight target of a named shape (``random_models.SHAPES``), as random_spec_model builds it."""
    config = AutoConfig.for_model("llama" if shape != "qwen3-8b" else "qwen3", **SHAPES[shape])
    return TargetModel.from_config(config, torch.bfloat16, device, seed)


def plan_for(target: TargetModel, batches: list[int], contexts: list[int], new_tokens: int, k: int,
             kv_cache_fraction: float, max_prefill_tokens: int) -> ContextPlan:
    """The plan for the memory free now (after the target's weights), KV counted with one draft layer."""
    free, _ = torch.cuda.mem_get_info(target.lm_head.weight.device)
    return plan_points(batches, contexts, new_tokens, k, kv_bytes_per_token(target.config), kv_cache_fraction * free,
                       max_prefill_tokens)


def build_model(target: TargetModel, mode: str, k: int, plan: ContextPlan, max_batch_size: int, compile_step: bool,
                workdir: str | Path, kv_cache_dtype: str = "auto") -> SpecModel:
    """A plain or EAGLE-3 model (a random head, drawn as random_spec_model draws it) over ``target`` with the
    plan's pool and sequence bound."""
    spec_config = None
    if mode == "eagle3":
        head = save_random_head(Path(workdir) / "eagle3", target.config, seed=1,
                                draft_vocab_size=min(target.vocab_size, DRAFT_VOCAB_SIZE))
        spec_config = Eagle3Config(speculative_model=str(head), max_draft_len=k)
    return SpecModel.from_target(target, spec_config, max_batch_size=max_batch_size, max_seq_len=plan.max_seq_len,
                                 num_pages=plan.num_pages, compile_step=compile_step, kv_cache_dtype=kv_cache_dtype,
                                 enable_prefix_caching=False)  # every point times its prompts' whole prefill


def release(model: SpecModel) -> None:
    """Free ``model``'s KV pool and CUDA graphs now (were its engine thread ever started, that thread would keep
    the model alive); the model cannot decode afterwards."""
    runner = model.runner
    runner.graph_runner = None
    for t in (*runner.kv_cache.k, *runner.kv_cache.v):
        t.untyped_storage().resize_(0)
    torch.cuda.empty_cache()


def context_points(target: TargetModel, plan: ContextPlan, batches: list[int], contexts: list[int], k: int,
                   new_tokens: int, bandwidth: float, max_prefill_tokens: int, compile_step: bool, workdir: str | Path,
                   kv_cache_dtypes: tuple[str, ...] = ("auto",)) -> Iterator[dict]:
    """Rows of every (KV pool dtype, mode, batch, context): measured (ContextPoint as a dict, its
    ``kv_cache_dtype`` added) or skipped with the reason. Every pool has the plan's pages (an FP8 one: half the
    bytes)."""
    for kv, mode in itertools.product(kv_cache_dtypes, MODES):
        yield from ({**row, "kv_cache_dtype": kv} for row in _points_of(target, plan, batches, contexts, k, new_tokens,
                                                                           bandwidth, max_prefill_tokens, compile_step,
                                                                           workdir, mode, kv))


def _points_of(target: TargetModel, plan: ContextPlan, batches: list[int], contexts: list[int], k: int,
               new_tokens: int, bandwidth: float, max_prefill_tokens: int, compile_step: bool, workdir: str | Path,
               mode: str, kv_cache_dtype: str) -> Iterator[dict]:
    """:func:`context_points` of one mode and KV pool dtype."""
    forced = float(k) if mode == "eagle3" else None
    todo = [(b, c) for b in batches for c in contexts]
    for b, c in todo:
        if (b, c) in plan.skipped:
            yield skipped_point(b, c, mode, forced, plan.skipped[(b, c)])
    todo = [p for p in todo if p not in plan.skipped]
    if not todo:
        return
    try:
        model = build_model(target, mode, k, plan, max(batches), compile_step, workdir, kv_cache_dtype)
    except torch.cuda.OutOfMemoryError as err:
        yield from (skipped_point(b, c, mode, forced, f"model build: out of memory ({err})"[:300]) for b, c in todo)
        return
    try:
        yield from _mode_points(model, mode, todo, new_tokens, forced, bandwidth, max_prefill_tokens)
    finally:
        release(model)
        del model
        gc.collect()  # the rest of the model (its engine and loop refer to each other)
        torch.cuda.empty_cache()


def _mode_points(model: SpecModel, mode: str, todo: list[tuple[int, int]], new_tokens: int, forced: float | None,
                 bandwidth: float, max_prefill_tokens: int) -> Iterator[dict]:
    """Capture the graphs, warm up each batch size on a short prompt, then measure ``todo`` (batch, context)."""
    force_acceptance(model, forced)  # before the capture: turning forcing on or off drops the graphs
    if model.runner.graph_runner is not None:
        model.runner.graph_runner.capture_all()
    warm_new_tokens = min(new_tokens, 4 * (model.max_draft_len + 1))
    warm_ups = [(b, min(128, *(c for x, c in todo if x == b))) for b in sorted({b for b, _ in todo})]
    warm_ups.append((warm_ups[0][0], min(32768, max(c for _, c in todo))))  # a long prompt: its prefill kernels
    for batch, context in warm_ups:  # prefill, mixed and decode steps of each batch size, compiled before timing
        measure_context_point(model, batch, context, warm_new_tokens, forced, bandwidth, max_prefill_tokens, seed=1)
    for batch, context in todo:
        try:
            point = measure_context_point(model, batch, context, new_tokens, forced, bandwidth, max_prefill_tokens)
        except (torch.cuda.OutOfMemoryError, ValueError) as err:  # a refused request: out of memory or of room
            gc.collect()
            torch.cuda.empty_cache()
            yield skipped_point(batch, context, mode, forced, f"{type(err).__name__}: {err}"[:300])
            continue
        yield asdict(point)
