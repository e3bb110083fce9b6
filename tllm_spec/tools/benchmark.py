"""Decode-speed measurement against the memory roofline and HF generate, on random-weight models."""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from ..config import SamplingParams
from ..drafts.mtp.worker import MTPWorker
from ..model.moe import MoE
from ..sampling import flashinfer_ops
from ..sampling.forcing import ENV_VAR
from ..spec_model import SpecModel
from .routing import Routing, moe_layers, routing_logs, routing_of


@dataclass
class Point:
    """One measured configuration."""

    mode: str  # the drafter (spec_kind: "eagle3", "eagle3+sa", "mtp", "draft_target", "sa") or "none"
    batch: int
    draft_len: int  # drafts proposed per step (0 for "none", and for a step scheduled without drafts)
    forced_drafts: float | None  # forced accepted drafts per step (None: no speculation)
    step_ms: float
    host_ms_per_step: float
    tokens_per_step: float  # per request, bonus included
    tokens_per_second: float
    roofline_bytes_per_step: float
    roofline_tokens_per_second: float
    roofline_fraction: float
    peak_memory_gib: float
    path: str = ""  # what ran (engine_path): tllm_spec's fused or stock HF layers, CUDA graphs or eager steps
    # mixture-of-experts targets (None for dense ones), from a counting pass after the timed run (measure_routing)
    distinct_experts_per_layer: float | None = None  # distinct experts a MoE layer reads per decoding step, mean
    expert_bytes_per_step: float | None = None  # the expert weights a decoding step reads (in roofline_bytes_per_step)
    routing_steps: int | None = None  # decoding steps those means are over
    routing_same_tokens: bool | None = None  # the counting pass generated the timed run's tokens (so its routing)
    draft_experts_per_step: float | None = None  # a MoE MTP block: its passes' distinct experts per step, summed
    draft_expert_bytes_per_step: float | None = None  # the expert weights they are (in roofline_bytes_per_step)


def measure_bandwidth(device: torch.device, gib: float = 2.0) -> dict[str, float]:
    """HBM read bandwidth seen by a bf16 GEMV (what decoding does) and by a plain reduction, in bytes/s."""
    cols = 8192
    rows = int(gib * 2**30 / 2 / cols)
    weight = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
    vec = torch.randn(cols, 1, device=device, dtype=torch.bfloat16)
    nbytes = weight.numel() * 2
    rates = {}
    for name, fn in (("gemv", lambda: weight @ vec), ("read", lambda: weight.sum(dtype=torch.float32))):
        for _ in range(3):
            fn()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize(device)
        rates[name] = nbytes * 20 / (time.perf_counter() - start)
    return rates


def _param_bytes(module: torch.nn.Module, skip: tuple[torch.nn.Module, ...] = (),
                 skip_tensors: tuple[torch.Tensor, ...] = ()) -> int:
    skipped = {id(p) for m in skip for p in m.parameters()} | {id(t) for t in skip_tensors}
    scales = [b for name, b in module.named_buffers() if name.endswith("_scale")]  # FP8 layers' scales
    return sum(p.numel() * p.element_size() for p in [*module.parameters(), *scales] if id(p) not in skipped)


def step_bytes(model: SpecModel, batch: int, context_len: float, draft_len: int | None = None,
               routing: Routing | None = None) -> float:
    """Bytes a generation step must read at least: target weights once, draft weights per pass, KV.
    ``draft_len``: the step's drafts (default max_draft_len); with 0 the draft's first pass still reads its
    layer (it keeps the draft cache whole) but not its lm_head. A mixture-of-experts target reads its other weights
    once (attention, routers, norms, shared experts, dense layers, lm_head) and, per MoE layer, only the distinct
    experts the step's tokens were routed to: ``routing`` (:func:`measure_routing`), which such a target needs; so
    does a MoE MTP block, whose passes each read their own distinct experts (:func:`mtp_bytes`)."""
    target = model.target
    layers = moe_layers(target)
    if layers and (routing is None or len(routing.expert_bytes) != len(layers)):
        raise ValueError(f"the target has {len(layers)} MoE layers: step_bytes needs their measured routing "
                         f"(measure_routing), got {'none' if routing is None else len(routing.expert_bytes)}")
    embed = target.decoder.embed_tokens
    tied = embed.weight is target.lm_head.weight
    experts = tuple(t for layer in layers for t in layer.expert_params)
    total = _param_bytes(target.hf, skip=() if tied else (embed,), skip_tensors=experts)
    total += routing.bytes_per_step if layers else 0.0
    kv = model.runner.kv_cache
    elem = kv.k[0].element_size()
    per_token_kv = [2 * k.shape[2] * k.shape[3] * elem for k in kv.k]
    total += batch * context_len * sum(per_token_kv[:target.num_layers])
    k = model.max_draft_len if draft_len is None else draft_len
    if getattr(model.worker, "tree_step", None) is not None and model.worker.is_tree(k):
        k = model.worker.tree_step.max_depth  # a tree's step: a head pass (and a read of its cache) per depth
    draft_kv = max(k, 1) * batch * context_len * sum(per_token_kv[target.num_layers:])  # a read per pass
    kind = spec_kind(model)
    if kind.startswith("eagle3"):
        draft = model.worker.draft_model
        fc = _param_bytes(draft.fc)
        shared = (draft.embed_tokens,) if draft.embed_tokens is embed else ()
        per_pass = _param_bytes(draft, skip=(draft.fc, draft.embed_tokens, *shared))
        total += fc + (k * per_pass if k else _param_bytes(draft.midlayer)) + draft_kv
    elif kind == "draft_target":  # k passes (the catch-up pass and k - 1 one-token ones), each reads every layer
        draft = model.worker.draft_model
        draft_layers = _param_bytes(draft.decoder, skip=(draft.decoder.embed_tokens,))
        total += max(k, 1) * draft_layers + k * _param_bytes(draft.lm_head) + draft_kv
    elif kind.startswith("mtp"):
        total += mtp_bytes(model.worker, k, routing, per_token_kv[target.num_layers:], batch * context_len)
    return total  # SA reads no draft weights (its match arrays, a few bytes per position, are not counted)


def mtp_bytes(worker, draft_len: int, routing: Routing | None, kv_per_token: list[int], kv_tokens: float) -> float:
    """Bytes the draft passes of an MTP step read (worker: an MTP worker): each pass the blocks, eh_proj and norms
    of the modules it runs and their KV layers (``kv_per_token`` [module] bytes, over ``kv_tokens`` positions); a
    MoE block its non-expert weights there and its experts as ``routing`` measured them; each proposal its
    module's head: its own, else the target's lm_head again (this rank's rows when tensor parallel)."""
    draft = worker.draft_model
    layers = moe_layers(draft)
    if layers and (routing is None or len(routing.draft_expert_bytes) != len(layers)):
        raise ValueError(f"the MTP modules have {len(layers)} MoE blocks: step_bytes needs their measured routing "
                         "(measure_routing)")
    experts = tuple(t for layer in layers for t in layer.expert_params)
    passes, proposals = mtp_passes(worker, draft_len)
    total = routing.draft_bytes_per_step if layers else 0.0
    for m in (m for modules in passes for m in modules):
        module = draft.mtp_modules[m]
        own_head = (module.shared_head["head"],) if "head" in module.shared_head else ()
        total += _param_bytes(module, skip=own_head, skip_tensors=experts) + kv_tokens * kv_per_token[m]
    for m in proposals:
        shared_head = draft.mtp_modules[m].shared_head
        head = shared_head["head"] if "head" in shared_head else draft.lm_head  # noqa: SIM401 (a ModuleDict)
        total += _param_bytes(head)
    return total


def mtp_passes(worker, draft_len: int) -> tuple[list[tuple[int, ...]], list[int]]:
    """(the modules each draft pass of an MTP step runs, the module each draft is proposed from). Vanilla MTP: every
    module once, a draft each. MTP-Eagle (``MTPEagleWorker.draft``): pass s runs the modules used at step s or
    later; ``draft_len`` drafts, none at 0 (its one pass only writes the modules' KV)."""
    if isinstance(worker, MTPWorker):
        return [(m,) for m in range(worker.max_draft_len)], list(range(worker.max_draft_len))
    steps = worker.step_modules
    return [tuple(sorted(set(steps[s:]))) for s in range(max(draft_len, 1))], list(steps[:draft_len])


def spec_kind(model: SpecModel) -> str:
    """What drafts a model's steps: "none", "eagle3", "mtp", "draft_target" or "sa" (+ "+sa" for a head with the
    suffix-automaton enhancer)."""
    mode = model.runner.model.mode
    kind = ("none" if mode.is_none() else "eagle3" if mode.is_eagle3_one_model() else "mtp" if mode.is_mtp_one_model()
            else "draft_target" if mode.is_draft_target_one_model() else "sa")
    return kind + "+sa" if model.worker.sa_enhancer is not None else kind


def force_acceptance(model: SpecModel, forced: float | None) -> None:
    """Set TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS to ``forced`` (None: unset) and make ``model`` read it."""
    if forced is None:
        os.environ.pop(ENV_VAR, None)
    else:
        os.environ[ENV_VAR] = str(forced)
    model.runner.refresh_forced_acceptance()


def run_point(model: SpecModel, batch: int, prompt_len: int, new_tokens: int, forced: float | None,
              bandwidth: float, seed: int = 0) -> Point:
    """Decode ``batch`` random prompts with forcing ``forced`` (None: leave acceptance alone); for a
    mixture-of-experts target the same run again, eagerly, to count the experts its steps read
    (:func:`measure_routing`)."""
    force_acceptance(model, forced)
    flashinfer_ops.wait_sampling_build()  # no timing shares the host with FlashInfer's JIT build
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.target.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    model.generate(prompts, params.model_copy(update={"max_new_tokens": 2 * model.max_draft_len + 4}))  # capture
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)
    outputs = model.generate(prompts, params, seed=seed)
    stats = outputs.stats
    peak_gib = torch.cuda.max_memory_allocated(model.device) / 2**30 if model.device.type == "cuda" else 0.0
    draft_len = model.runner.draft_len_for(batch)
    counted = measure_routing(model, prompts, params, seed, batch * (draft_len + 1))
    routing = counted[0] if counted is not None else None
    per_step = (stats["mean_accepted_length"] if draft_len else 0.0) or 1.0
    step_s = stats["step_ms"] / 1e3
    bytes_per_step = step_bytes(model, batch, prompt_len + new_tokens / 2, draft_len, routing)
    roofline_tps = batch * per_step * bandwidth / bytes_per_step
    tps = stats["mean_decode_batch"] * per_step / step_s
    moe = {} if routing is None else {"distinct_experts_per_layer": routing.mean_distinct,
                                      "expert_bytes_per_step": routing.bytes_per_step,
                                      "routing_steps": routing.num_steps,
                                      "routing_same_tokens": counted[1] == [o.token_ids for o in outputs]}
    if routing is not None and routing.draft_expert_bytes:  # a MoE MTP block
        moe.update(draft_experts_per_step=routing.mean_draft_experts,
                   draft_expert_bytes_per_step=routing.draft_bytes_per_step)
    return Point(spec_kind(model), batch, draft_len, forced, stats["step_ms"], stats["host_ms_per_step"], per_step,
                 tps, bytes_per_step, roofline_tps, tps / roofline_tps, peak_gib, engine_path(model), **moe)


def measure_routing(model: SpecModel, prompts: list[list[int]], params: SamplingParams, seed: int, max_rows: int
                    ) -> tuple[Routing, list[list[int]]] | None:
    """The distinct experts each MoE layer of ``model``'s target (and its draft's: an MTP block's passes) reads per
    decoding step, from a run of ``prompts`` with its steps eager (graph replays log no routing), and the token ids
    that run generated: with the timed run's prompts, forcing and seed they are the timed run's (eager and graphed
    numerics may still part them), and so is the routing. Steps of more than ``max_rows`` target tokens (batch x
    (draft_len + 1)) are prompt steps, left out. None for a dense target (its MTP blocks, its layer class, too)."""
    layers = moe_layers(model.target)
    if not layers:
        return None
    draft = getattr(model.worker, "draft_model", None)
    draft_layers = moe_layers(draft) if draft is not None else []
    with eager_steps(model), routing_logs(layers, draft_layers) as logs:
        outputs = model.generate(prompts, params, seed=seed)
    return routing_of(layers, logs, max_rows, draft_layers), [o.token_ids for o in outputs]


@contextlib.contextmanager
def eager_steps(model: SpecModel) -> Iterator[None]:
    """Inside the block ``model``'s steps run eagerly: its runner holds no graph runner (so it replays no CUDA
    graph and launches no step ahead; the captured graphs are set aside, not dropped) and torch.compile'd code runs
    as plain Python. Call it between generate calls (the engine's thread reads the runner at each step)."""
    runner = model.runner
    graphs, runner.graph_runner = runner.graph_runner, None
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        runner.graph_runner = graphs


def engine_path(model: SpecModel) -> str:
    """What runs ``model``'s generation steps: tllm_spec's fused layers or the stock HF modules (and, for a
    mixture-of-experts target, which experts), CUDA graphs (compiled or not) or eager steps."""
    target, graphs, layers = model.target, model.runner.graph_runner, moe_layers(model.target)
    parts = ["tllm_spec engine", "fused layers" if target.fused is not None else "stock HF layers"]
    if layers:
        parts.append("fused MoE" if isinstance(layers[0].module, MoE) else
                     f"stock HF experts (experts_implementation={target.hf.config._experts_implementation})")
    compiled = graphs is not None and (graphs.compile_step or target.compiled or target._fused_compiled is not None)
    parts.append("eager steps" if graphs is None else "CUDA graphs" + (", compiled" if compiled else ""))
    return ", ".join(parts)


def expected_accepted_drafts(draft_len: int, acceptance: float) -> float:
    """Mean accepted drafts of a chain of ``draft_len`` drafts when each is accepted with probability
    ``acceptance`` given the ones before: sum_{i=1..k} a^i."""
    return sum(acceptance ** i for i in range(1, draft_len + 1))


def sweep_draft_len(model: SpecModel, batches: list[int], prompt_len: int, new_tokens: int, acceptance: float,
                    bandwidth: float, on_point: Callable[[Point], None] | None = None
                    ) -> tuple[list[Point], dict[int, int]]:
    """Every draft length 0..K at every batch size, acceptance forced to :func:`expected_accepted_drafts`
    (a realistic chain rather than a perfect draft); returns the points and the fastest draft length per
    batch size as a ``draft_len_schedule``; ``on_point`` sees each point as it is measured. The model's own
    schedule is restored afterwards."""
    saved, points = model.runner.draft_len_schedule, []
    try:
        for batch in batches:
            for k in range(model.max_draft_len + 1):
                model.runner.set_draft_len_schedule({1: k})
                forced = expected_accepted_drafts(k, acceptance) if k else None
                points.append(run_point(model, batch, prompt_len, new_tokens, forced, bandwidth))
                if on_point is not None:
                    on_point(points[-1])
    finally:
        model.runner.set_draft_len_schedule(saved)
    return points, best_schedule(points)


def best_schedule(points: list[Point]) -> dict[int, int]:
    """{batch: fastest draft length} over the measured batch sizes, with the smallest batch keyed 1 (what a
    draft_len_schedule needs) and repeated lengths merged into the smaller key."""
    fastest = {}
    for batch in sorted({p.batch for p in points}):
        fastest[batch] = max((p for p in points if p.batch == batch), key=lambda p: p.tokens_per_second).draft_len
    schedule, last = {}, None
    for i, (batch, k) in enumerate(fastest.items()):
        if k != last:
            schedule[1 if i == 0 else batch] = k
            last = k
    return schedule


def to_rows(points: list[Point]) -> list[dict]:
    return [asdict(p) for p in points]


_KERNEL_GROUPS = (("gemm", ("gemm", "gemv", "cutlass", "sm90_xmma", "cublas", "splitk", "nvjet",
                            "_skinny_linear_kernel")),
                  ("paged attention + KV write (triton)", ("_paged_attention_kernel", "_kv_write_kernel")),
                  ("sampling (flashinfer)", ("sampling", "TopK", "flashinfer")),
                  ("copy / index", ("copy", "index", "gather", "scatter", "cat")),
                  ("reduce / norm", ("reduce", "norm", "mean")))


def profile_step(model: SpecModel, batch: int, prompt_len: int, forced: float | None, steps: int = 20) -> dict:
    """GPU kernel time of the graphed generation step (replays of the captured bucket graph), grouped by kind."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    force_acceptance(model, forced)
    if model.runner.graph_runner is None:
        raise ValueError("profile_step profiles the CUDA-graph step: build the model without enforce_eager")
    prompts = [list(range(1, prompt_len + 1))] * batch
    model.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))  # captures; fills the inputs
    k = model.runner.draft_len_for(batch)
    runner = model.runner
    graph = runner.graph_runner.graphs[(runner.graph_runner.bucket(batch), k, k, *runner.spec_metadata.variant)][0]
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - start) * 1e3 / steps
    groups: dict[str, float] = {}
    top: list[tuple[float, int, str]] = []
    kernels = 0
    for evt in prof.key_averages():
        us = evt.device_time_total
        if evt.device_type != DeviceType.CUDA or not us:
            continue
        kernels += evt.count
        top.append((us / steps, evt.count // steps, evt.key[:90]))
        group = next((g for g, keys in _KERNEL_GROUPS if any(k.lower() in evt.key.lower() for k in keys)),
                     "elementwise / other")
        groups[group] = groups.get(group, 0.0) + us / steps
    return {"mode": spec_kind(model), "batch": batch, "forced_drafts": forced,
            "kernel_us_per_step": {g: round(v, 1) for g, v in sorted(groups.items(), key=lambda x: -x[1])},
            "total_kernel_us_per_step": round(sum(groups.values()), 1), "kernels_per_step": kernels / steps,
            "top_kernels": [{"us_per_step": round(us, 1), "calls_per_step": n, "name": name}
                            for us, n, name in sorted(top, reverse=True)[:24]],
            "graph_step_ms": step_ms}


def format_profile(p: dict) -> str:
    lines = [(f"profile {p['mode']} batch {p['batch']} forced {p['forced_drafts']}: "
             f"{p['total_kernel_us_per_step'] / 1e3:.2f} ms of kernels per step in {p['kernels_per_step']:.0f} "
             f"launches (graph replay {p['graph_step_ms']:.2f} ms, profiler on)")]
    if p["total_kernel_us_per_step"] > 1e3 * p["graph_step_ms"]:
        lines.append("  (kernels launched as programmatic dependents start early: each one's time includes its wait "
                     "on the one in front, so they exceed the replay; TLLM_SPEC_DEPENDENT_LAUNCH=0: their own times)")
    lines += [f"  {g:28s} {us / 1e3:7.3f} ms" for g, us in p["kernel_us_per_step"].items()]
    lines += [f"    {k['us_per_step'] / 1e3:7.3f} ms  x{k['calls_per_step']:<4d} {k['name']}" for k in p["top_kernels"]]
    return "\n".join(lines)
