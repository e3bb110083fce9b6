"""SpecModel: a Hugging Face causal LM with the draft network inside its forward (one-model speculation)."""
from __future__ import annotations

import bisect
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from . import demo
from .attention import AttentionMetadata
from .config import EngineConfig, Eagle3Config, MTPConfig, RunConfig, SamplingParams, check_draft_len_schedule
from .drafts.eagle3 import Eagle3DraftModel, resolve_capture_layers
from .drafts.eagle3_checkpoint import load_eagle3_checkpoint
from .cuda_graphs import CUDAGraphRunner, pack_outputs
from .engine import Engine, GenerationOutputs
from .forced_acceptance import read_forced_num_accepted
from .grammar import GrammarCompiler
from .guided import GuidedDecoder
from .kv_cache import KVCache
from .metadata import SpecMetadata
from .modes import SpeculativeDecodingMode
from .parallel import TensorParallel, broadcast_from_first, local_process_device
from .target import TargetModel
from .tokenizer import load_tokenizer
from .workers.base import SpecWorkerBase
from .workers.eagle3 import Eagle3OneModelWorker
from .workers.mtp import build_mtp_worker
from .workers.plain import PlainWorker

_DEFAULT_MAX_SEQ_LEN = 8192


class SpecModel(nn.Module):
    """The one-model step (:meth:`forward`) and a batched ``generate`` around it."""

    def __init__(self, target: TargetModel, worker: SpecWorkerBase, mode: SpeculativeDecodingMode,
                 engine_config: EngineConfig, tokenizer=None, draft_len_schedule: Mapping[int, int] | None = None):
        super().__init__()
        self.target, self.worker, self.mode, self.tokenizer = target, worker, mode, tokenizer
        self.engine_config = engine_config
        self.max_draft_len = worker.max_draft_len
        self.set_draft_len_schedule(draft_len_schedule)  # self._schedule: [(smallest batch size, k)], sorted
        self.max_batch_size = engine_config.max_batch_size
        self.max_seq_len = engine_config.max_seq_len or min(
            getattr(target.config, "max_position_embeddings", _DEFAULT_MAX_SEQ_LEN), _DEFAULT_MAX_SEQ_LEN)
        self.eos_token_ids = _eos_token_ids(target, tokenizer)
        self.spec_metadata = SpecMetadata(self.max_batch_size, self.max_draft_len, target.vocab_size, self.device)
        self.kv_cache = self._make_kv_cache()
        worker.allocate_state(self.max_batch_size + 1, target.vocab_size, self.device)  # + the padding slot
        self.num_kv_pages = self.kv_cache.k[0].shape[0]
        if engine_config.use_fused_layers:
            target.fuse(self.max_positions_per_request)
            worker.fuse(self.max_positions_per_request)
        use_graphs = self.device.type == "cuda" and not engine_config.enforce_eager
        self._compile_whole = use_graphs and engine_config.compile_step and self.compiles_step_whole
        if use_graphs and engine_config.compile_step and not self._compile_whole:
            target.compile()
            worker.compile()
        self.graph_runner = self._new_graph_runner() if use_graphs else None

    def _new_graph_runner(self) -> CUDAGraphRunner:
        """A runner without captured graphs (the compiled step's Dynamo cache is kept: it lives on the code)."""
        return CUDAGraphRunner(self, self._compile_whole)

    @property
    def compiles_step_whole(self) -> bool:
        """Whether ``compile_step`` compiles the graphed step whole (a fused target on one GPU) rather than the
        target's layers and the EAGLE-3 head's passes module by module (stock layers, tensor parallel)."""
        return self.target.fused is not None and self.target.parallel is None

    @classmethod
    def from_pretrained(cls, target_dir: str | Path, spec_config: Eagle3Config | MTPConfig | None = None,
                        dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
                        engine_config: EngineConfig | None = None, **engine_kwargs) -> SpecModel:
        """Load a local HF causal-LM directory (``demo://target`` for the embedded default) and its draft.

        ``engine_kwargs`` override fields of ``engine_config`` (e.g. ``max_batch_size=4``). With
        ``tensor_parallel_size=N`` every one of the N ranks (``torchrun --nproc-per-node N``) makes this call
        and loads its shard of the target and a whole copy of the draft.
        """
        engine_config = _engine_config(engine_config, engine_kwargs)
        device = _resolve_device(device)
        parallel = _tensor_parallel(engine_config, spec_config, device)
        device = local_process_device(device) if parallel else device
        target_dir = demo.resolve(target_dir)
        target = TargetModel.load(target_dir, _resolve_dtype(dtype, device), device, parallel)
        return cls.from_target(target, spec_config, engine_config, load_tokenizer(target_dir))

    @classmethod
    def from_target(cls, target: TargetModel, spec_config: Eagle3Config | MTPConfig | None = None,
                    engine_config: EngineConfig | None = None, tokenizer=None, **engine_kwargs) -> SpecModel:
        """Wrap an already loaded (or randomly initialised) target and load the draft for it."""
        engine_config = _engine_config(engine_config, engine_kwargs)
        tp_size = target.parallel.size if target.parallel else 1
        if engine_config.tensor_parallel_size != tp_size:
            raise ValueError(f"tensor_parallel_size={engine_config.tensor_parallel_size} but the target is split "
                             f"over {tp_size} ranks")
        if tp_size > 1:
            _check_tp_spec(spec_config)
        dtype, device = target.lm_head.weight.dtype, target.lm_head.weight.device
        mode = spec_config.spec_dec_mode if spec_config is not None else SpeculativeDecodingMode.NONE
        if mode.is_eagle3_one_model():
            worker = _eagle3_worker(target, spec_config, dtype, device)
        elif mode.is_mtp_one_model():
            worker = build_mtp_worker(target, spec_config, engine_config.max_batch_size)
        else:
            worker = PlainWorker()
        schedule = spec_config.draft_len_schedule if spec_config is not None else None
        return cls(target, worker, mode, engine_config, tokenizer, schedule)

    @classmethod
    def from_run_config(cls, cfg: RunConfig) -> SpecModel:
        """Build from a validated YAML run file (``target_model: None`` = the embedded demo target)."""
        return cls.from_pretrained(cfg.target_model or "demo://target", cfg.spec_config, dtype=cfg.dtype,
                                   device=cfg.device, engine_config=cfg.engine)

    def draft_len_for(self, batch_size: int) -> int:
        """Drafts per request for a step of ``batch_size`` requests: the schedule's entry with the largest
        batch-size key <= batch_size (max_draft_len without a schedule)."""
        return self._schedule[bisect.bisect_right(self._schedule, (batch_size, math.inf)) - 1][1]

    @property
    def draft_len_schedule(self) -> dict[int, int]:
        """{smallest batch size: draft length} in effect (``{1: max_draft_len}`` without a schedule)."""
        return dict(self._schedule)

    def set_draft_len_schedule(self, schedule: Mapping[int, int] | None) -> None:
        """Replace the draft-length schedule (benchmark sweeps; the config's rules apply). Captured graphs are
        kept: they are keyed by their draft lengths."""
        if schedule is not None and self.mode.is_mtp_vanilla():
            raise ValueError("draft_len_schedule: vanilla MTP drafts exactly num_nextn_predict_layers tokens")
        check_draft_len_schedule(dict(schedule) if schedule is not None else None, self.max_draft_len)
        self._schedule = sorted((schedule or {1: self.max_draft_len}).items())

    def refresh_forced_acceptance(self) -> None:
        """Re-read TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS (benchmark sweeps). The steps read the forced
        count from a device tensor, so captured graphs stay valid for a new count; they are dropped only when
        forcing turns on or off, which changes the step's code."""
        was_forcing = self.worker.forcing
        self.worker.forced_num_accepted = read_forced_num_accepted()
        if self.graph_runner is not None and self.worker.forcing != was_forcing:
            self.graph_runner = self._new_graph_runner()

    def enable_guided_decoding(self) -> str | None:
        """Give the worker a guided decoder (once; captured graphs are dropped so that they mask the logits).
        Returns why guided decoding is unavailable (no tokenizer, no llguidance), or None."""
        if self.worker.guided_decoder is not None:
            return None
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        try:
            compiler = GrammarCompiler(self.tokenizer, self.target.vocab_size,
                                       eos if eos is not None else next(iter(self.eos_token_ids), None))
        except (ImportError, ValueError) as err:
            return str(err)
        self.worker.set_guided_decoder(GuidedDecoder(compiler, self.max_batch_size, self.max_draft_len, self.device))
        if self.graph_runner is not None:
            self.graph_runner = self._new_graph_runner()
        return None

    @property
    def device(self) -> torch.device:
        return self.target.lm_head.weight.device

    def forward(self, input_ids: torch.Tensor, attn: AttentionMetadata, draft_tokens: torch.Tensor
                ) -> dict[str, torch.Tensor]:
        """One step: target over the packed batch -> logits at gather ids -> worker (sample, accept, draft).

        input_ids [T] int64 in the flat layout; draft_tokens [G, k] int64 (the drafts being verified, k =
        spec_metadata.draft_len). Returns new_tokens [B, k+1], new_tokens_lens [B], next_draft_tokens [B, k'],
        next_new_tokens [B, k'+1] (k' = spec_metadata.next_draft_len).
        """
        hidden, captured = self.target(input_ids, attn)
        self.spec_metadata.record_positions(attn.positions)
        logits = self.target.compute_logits(hidden[self.spec_metadata.gather_ids[:self.spec_metadata.num_rows]])
        features = captured if self.mode.is_eagle3_one_model() else hidden
        return self.worker(input_ids, logits, features, draft_tokens, attn, self.spec_metadata)

    def packed_forward(self, input_ids: torch.Tensor, attn: AttentionMetadata, draft_tokens: torch.Tensor
                       ) -> torch.Tensor:
        """:meth:`forward` with its outputs packed [B, 2K+3] int64 (one D2H copy; K = max_draft_len, shorter
        steps padded). Tensor parallel: rank 0's
        outputs on every rank (every rank computes the same tokens from the same gathered logits and seeds; the
        broadcast makes the host schedules of the ranks identical by construction)."""
        packed = pack_outputs(self(input_ids, attn, draft_tokens), self.max_draft_len)
        parallel = self.target.parallel
        return packed if parallel is None else broadcast_from_first(packed, parallel)

    def step(self, ids: list[int], positions: list[int], slots: list[int], drafts: list[int],
             params: list[SamplingParams], context_lens: tuple[int, ...], draft_len: int | None = None,
             next_draft_len: int | None = None) -> torch.Tensor:
        """Run one step from host-side inputs (flat layout, context requests first); returns the packed
        outputs [B, 2K+3] on the device. ``draft_len``: drafts each generation request verifies,
        ``next_draft_len``: drafts to propose (both default max_draft_len). Generation-only batches replay a
        CUDA graph when one is enabled."""
        k = self.max_draft_len if draft_len is None else draft_len
        next_k = self.max_draft_len if next_draft_len is None else next_draft_len
        num_gen = len(params) - len(context_lens)
        if self.graph_runner is not None and not context_lens and self.graph_runner.bucket(num_gen):
            return self.graph_runner.run(ids, positions, slots, drafts, params, k, next_k)
        self.spec_metadata.prepare(params, context_lens, k, next_k)
        device = self.device
        attn = AttentionMetadata.build(self.kv_cache, torch.tensor(slots, device=device),
                                       torch.tensor(positions, device=device),
                                       max(positions) + 2 * self.max_draft_len + 2, context_lens,
                                       tokens_per_request=k + 1)
        draft_tokens = torch.tensor(drafts, dtype=torch.int64, device=device).view(num_gen, k)
        return self.packed_forward(torch.tensor(ids, device=device), attn, draft_tokens)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[str | list[int]], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, seed: int = 0, progress: bool = False) -> GenerationOutputs:
        """Decode a batch of prompts (strings need the target's tokenizer) to completion."""
        if not isinstance(prompts, (list, tuple)) or any(not isinstance(p, (str, list, tuple)) for p in prompts):
            raise TypeError("prompts must be a list of strings or of token-id lists")
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        token_prompts = [self.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        guided_error = self.enable_guided_decoding() if any(p.guided_decoding for p in params) else None
        if self.graph_runner is not None:
            self.graph_runner.capture_all(params)  # once: warm-up and capture before the first timed step
        return Engine(self, guided_error).generate(token_prompts, params, seed, progress)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this target directory has no tokenizer: pass token-id lists instead of strings")
        return self.tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @property
    def max_positions_per_request(self) -> int:
        """Positions a request's step may touch (block-table width, RoPE tables): a step writes up to 2K - 1 past
        the committed length (target K, draft passes K - 1 more), and a step the engine runs ahead for a request
        that has just ended (``Engine._run``) starts up to K past its last committed length; block-table entries
        past a request's reserved pages point at the scratch page, so those writes land there."""
        return self.max_seq_len + 3 * self.max_draft_len + 2

    def _make_kv_cache(self) -> KVCache:
        shapes = self.target.kv_layer_shapes() + self.worker.kv_layer_shapes()
        per_request = self.max_positions_per_request
        page = self.engine_config.page_size
        num_pages = self.engine_config.num_pages or _auto_num_pages(
            shapes, page, self.max_batch_size * math.ceil(per_request / page) + 1, self.engine_config, self.device,
            self.target.lm_head.weight.dtype)
        return KVCache(shapes, num_pages, page, self.max_batch_size, per_request, self.target.lm_head.weight.dtype,
                       self.device)


def _engine_config(engine_config: EngineConfig | None, overrides: dict) -> EngineConfig:
    return EngineConfig.model_validate({**(engine_config or EngineConfig()).model_dump(), **overrides})


def _tensor_parallel(cfg: EngineConfig, spec_config: Eagle3Config | MTPConfig | None, device: torch.device
                     ) -> TensorParallel | None:
    """The tensor-parallel group, checked before any weight loads (the same error on every rank)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.tensor_parallel_size == 1 and launched == 1:
        return None
    _check_tp_spec(spec_config)
    return TensorParallel.setup(cfg.tensor_parallel_size, device)


def _check_tp_spec(spec_config: Eagle3Config | MTPConfig | None) -> None:
    if isinstance(spec_config, MTPConfig):
        raise ValueError("MTP with tensor_parallel_size > 1 is not supported yet (MTP modules share the target's "
                         "vocabulary-parallel lm_head); use EAGLE-3 or tensor_parallel_size=1")


def _eagle3_worker(target: TargetModel, cfg: Eagle3Config, dtype: torch.dtype, device: torch.device
                   ) -> Eagle3OneModelWorker:
    ckpt = load_eagle3_checkpoint(demo.resolve(cfg.speculative_model), target_hidden_size=target.hidden_size,
                                  target_vocab_size=target.vocab_size)
    target.capture_layers(resolve_capture_layers(cfg.eagle3_layers_to_capture, ckpt.config.aux_layer_ids,
                                                 target.num_layers))
    draft = Eagle3DraftModel.from_checkpoint(ckpt, target.num_layers, target.decoder.embed_tokens, dtype, device)
    return Eagle3OneModelWorker(cfg.max_draft_len, draft, use_rejection_sampling=cfg.use_rejection_sampling)


def _auto_num_pages(shapes: list[tuple[int, int]], page_size: int, wanted: int, cfg: EngineConfig,
                    device: torch.device, dtype: torch.dtype) -> int:
    """Pages for ``wanted`` on CPU; on GPU at most ``kv_cache_fraction`` of the free memory."""
    if device.type != "cuda":
        return wanted
    bytes_per_page = 2 * page_size * sum(h * d for h, d in shapes) * torch.finfo(dtype).bits // 8
    free, _ = torch.cuda.mem_get_info(device)
    return max(2, min(wanted, int(free * cfg.kv_cache_fraction) // bytes_per_page))


def _eos_token_ids(target: TargetModel, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(target.hf, "generation_config", None), target.config):
        eos = getattr(source, "eos_token_id", None)
        ids |= set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype
