"""Loading: a target directory and a spec config -> a :class:`ModelRunner` (device, dtype, tensor-parallel
group, the draft kind's worker). ``demo://`` addresses are resolved here, once, where the user's input enters."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig

from .. import demo
from ..config import DEMO_MTP, DEMO_TARGET, DraftTargetConfig, Eagle3Config, EngineConfig, MTPConfig, SAConfig
from ..distributed import symmetric
from ..distributed.parallel import TensorParallel, local_process_device
from ..drafts.base import SpecWorkerBase
from ..drafts.draft_target.worker import build_draft_target_worker
from ..drafts.eagle3.worker import build_eagle3_worker
from ..drafts.mtp.worker import build_mtp_worker
from ..drafts.plain import PlainWorker
from ..drafts.sa.worker import build_sa_worker
from ..model.quant.linear import quantize_linears
from ..model.target import TargetModel, check_max_seq_len, check_quantization
from ..modes import SpeculativeDecodingMode
from ..tokenizer import load_tokenizer
from .runner import ModelRunner

SpecConfig = Eagle3Config | MTPConfig | DraftTargetConfig | SAConfig
# one build function per draft kind, the same shape for each: (target, config, max_batch_size) -> worker
WORKER_BUILDERS: dict[type, Callable[[TargetModel, SpecConfig, int], SpecWorkerBase]] = {
    Eagle3Config: build_eagle3_worker, MTPConfig: build_mtp_worker, DraftTargetConfig: build_draft_target_worker,
    SAConfig: build_sa_worker}


def load_runner(target_dir: str | Path, spec_config: SpecConfig | None, dtype: torch.dtype | str | None,
                device: torch.device | str | None, engine_config: EngineConfig, quantization: str | None = None,
                draft_quantization: str | None = None) -> ModelRunner:
    """Load a local HF causal-LM directory (``demo://target`` for the embedded default) and its draft. With
    ``tensor_parallel_size=N`` every one of the N ranks (``torchrun --nproc-per-node N``) makes this call and
    loads its shard of the target and a whole copy of the draft (an EAGLE-3 head, MTP modules, a draft LM)."""
    device = resolve_device(device)
    parallel = _tensor_parallel(engine_config, device)
    device = local_process_device(device) if parallel else device
    if str(target_dir) == DEMO_TARGET and isinstance(spec_config, MTPConfig) and spec_config.mtp_checkpoint is None:
        spec_config = spec_config.model_copy(update={"mtp_checkpoint": DEMO_MTP})  # shipped beside the target
    target_dir = demo.resolve(target_dir)
    check_positions(target_dir, engine_config.max_seq_len)
    target = TargetModel.load(target_dir, resolve_dtype(dtype, device), device, parallel, quantization)
    return runner_for_target(target, spec_config, engine_config, load_tokenizer(target_dir), draft_quantization)


def check_positions(target_dir: Path, max_seq_len: int | None) -> None:
    """Refuse a ``max_seq_len`` past the positions of the target checkpoint at ``target_dir`` (its config.json alone,
    before any weight loads; a config that cannot be read is left to TargetModel.load to report). Checkpoints only:
    benchmarks run random targets (runner_for_target) past their positions, a 131072-token context and its new
    tokens on the 8B shape."""
    if max_seq_len is None or not (Path(target_dir) / "config.json").is_file():
        return
    try:
        config = AutoConfig.from_pretrained(target_dir)
    except (ValueError, OSError):
        return
    check_max_seq_len(config, max_seq_len)


def runner_for_target(target: TargetModel, spec_config: SpecConfig | None, engine_config: EngineConfig,
                      tokenizer=None, draft_quantization: str | None = None) -> ModelRunner:
    """Wrap an already loaded (or randomly initialised) target and load the draft for it; ``draft_quantization``
    ``"fp8"``: the draft network's own linear layers quantized online (:meth:`SpecWorkerBase.draft_network`)."""
    tp_size = target.parallel.size if target.parallel else 1
    if engine_config.tensor_parallel_size != tp_size:
        raise ValueError(f"tensor_parallel_size={engine_config.tensor_parallel_size} but the target is split "
                         f"over {tp_size} ranks")
    if tp_size > 1 and engine_config.tp_all_reduce != "nccl":  # every rank, together: a rendezvous
        weight = target.lm_head.weight
        symmetric.enable(target.parallel.group_name, weight.dtype, weight.device, engine_config.tp_all_reduce)
    check_quantization(draft_quantization)
    if spec_config is None:
        if draft_quantization:
            raise ValueError("draft_quantization is given but there is no draft (spec_config=None)")
        return ModelRunner(target, PlainWorker(), SpeculativeDecodingMode.NONE, engine_config, tokenizer)
    spec_config = resolve_demo_paths(spec_config)
    worker = WORKER_BUILDERS[type(spec_config)](target, spec_config, engine_config.max_batch_size)
    if draft_quantization:
        quantize_draft(worker)
    if tp_size > 1 and (engine_config.tp_draft == "sharded"
                        or (engine_config.tp_draft == "auto" and worker.shard_refusal(target.parallel) is None)):
        worker.shard_draft(target.parallel)
    return ModelRunner(target, worker, spec_config.spec_dec_mode, engine_config, tokenizer,
                       spec_config.draft_len_schedule)


def quantize_draft(worker: SpecWorkerBase) -> None:
    """FP8 for the draft network's own linear layers (an EAGLE-3 head's, MTP modules', a draft LM's; never the
    target's, which a draft may share): before any fusing, so its fused projections are FP8 too."""
    network = worker.draft_network()
    if network is None:
        raise ValueError(f"draft_quantization: {type(worker).__name__} has no draft network to quantize")
    if quantize_linears(network) == 0:
        raise ValueError(f"draft_quantization: {type(worker).__name__}'s draft has no linear layer to quantize")


def resolve_demo_paths(spec_config: SpecConfig) -> SpecConfig:
    """The config with its ``demo://`` checkpoint addresses replaced by the shipped directories."""
    field = {Eagle3Config: "speculative_model", DraftTargetConfig: "speculative_model",
             MTPConfig: "mtp_checkpoint"}.get(type(spec_config))
    value = None if field is None else getattr(spec_config, field)
    return spec_config if value is None else spec_config.model_copy(update={field: str(demo.resolve(value))})


def engine_config_with(engine_config: EngineConfig | None, overrides: dict) -> EngineConfig:
    """``engine_config`` (default: EngineConfig()) with ``overrides`` applied and validated."""
    return EngineConfig.model_validate({**(engine_config or EngineConfig()).model_dump(), **overrides})


def resolve_device(device: torch.device | str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _tensor_parallel(cfg: EngineConfig, device: torch.device) -> TensorParallel | None:
    """The tensor-parallel group, checked before any weight loads (the same error on every rank)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.tensor_parallel_size == 1 and launched == 1:
        return None
    return TensorParallel.setup(cfg.tensor_parallel_size, device)
