"""SpecModel: the user-facing entry — load a Hugging Face causal LM with its draft (EAGLE-3 head or MTP
modules) and decode. It owns one long-lived :class:`EngineLoop` (the thread that owns the GPU) around an
:class:`Engine`, which owns the :class:`ModelRunner`, which owns the one-model step (:class:`OneModel`, the
nn.Module). Safe to call from several threads: every call becomes messages to the engine thread."""
from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from .config import EngineConfig, RunConfig, SamplingParams, SpecConfig
from .drafts.base import SpecWorkerBase
from .engine import streams
from .engine.async_engine import AsyncEngine
from .engine.cuda_graphs import variant_example
from .engine.engine import Engine
from .engine.loader import engine_config_with, load_runner, runner_for_target
from .engine.loop import EngineLoop
from .engine.request import GenerationOutputs
from .engine.runner import ModelRunner
from .model.target import TargetModel
from .modes import SpeculativeDecodingMode
from .sampling.logprobs import logprobs_width

log = logging.getLogger("tllm_spec")
WARMUP_VARIANTS = ((True, False, 0), (False, False, 0), (False, True, 0))  # greedy, sampled, sampled with seeds


class SpecModel:
    """A target with its draft inside its forward, and ``generate`` around it."""

    def __init__(self, runner: ModelRunner):
        self.loop = EngineLoop(Engine(runner))
        # at exit, before the process group's own hook (registered earlier, while loading: hooks run last-in first
        # out); on the loop, which outlives this object while its thread runs (a program's main() may have returned)
        atexit.register(_close_at_exit, weakref.ref(self.loop))

    def close(self) -> None:
        """Stop the engine's thread (requests still running end with "abort", their pages freed) and release the
        CUDA graphs. Done at interpreter exit for every engine still running: a tensor-parallel rank cannot close
        its NCCL communicator while graphs that captured its collectives exist (its ranks hung at exit)."""
        _close(self.loop)

    def __enter__(self) -> SpecModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def from_pretrained(cls, target_dir: str | Path, spec_config: SpecConfig | None = None,
                        dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
                        engine_config: EngineConfig | None = None, quantization: str | None = None,
                        draft_quantization: str | None = None, **engine_kwargs) -> SpecModel:
        """Load a local HF causal-LM directory (``demo://target`` for the embedded default) and its draft.

        An FP8 checkpoint loads as FP8 (its config names the format); ``quantization="fp8"`` quantizes a 16-bit
        target's linear layers at load (the lm_head stays), the draft only with ``draft_quantization="fp8"``
        (else it keeps its own checkpoint's precision).

        ``engine_kwargs`` override fields of ``engine_config`` (e.g. ``max_batch_size=4``). With
        ``tensor_parallel_size=N`` every one of the N ranks (``torchrun --nproc-per-node N``) makes this call
        and loads its shard of the target and a whole copy of the draft.
        """
        config = engine_config_with(engine_config, engine_kwargs)
        return cls(load_runner(target_dir, spec_config, dtype, device, config, quantization, draft_quantization))

    @classmethod
    def from_target(cls, target: TargetModel, spec_config: SpecConfig | None = None,
                    engine_config: EngineConfig | None = None, tokenizer=None, **engine_kwargs) -> SpecModel:
        """Wrap an already loaded (or randomly initialised) target and load the draft for it."""
        config = engine_config_with(engine_config, engine_kwargs)
        return cls(runner_for_target(target, spec_config, config, tokenizer))

    @classmethod
    def from_run_config(cls, cfg: RunConfig) -> SpecModel:
        """Build from a validated YAML run file (``target_model: None`` = the embedded demo target)."""
        return cls.from_pretrained(cfg.target_model or "demo://target", cfg.spec_config, dtype=cfg.dtype,
                                   device=cfg.device, engine_config=cfg.engine, quantization=cfg.quantization,
                                   draft_quantization=cfg.draft_quantization)

    def generate(self, prompts: Sequence[str | list[int]], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, seed: int = 0, progress: bool = False) -> GenerationOutputs:
        """Decode a batch of prompts (strings need the target's tokenizer) to completion. ``seed`` restarts the
        stream that sampled requests without their own seed draw from. A refused prompt gets a "rejected" output
        and a warning; Ctrl-C aborts the call's requests and frees their pages before it propagates."""
        return streams.generate(self.loop, prompts, sampling_params, seed, progress, stacklevel=3)

    def generate_stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                        request_id: str | None = None) -> streams.RequestStream:
        """One request whose output arrives step by step: ``for out in model.generate_stream(...)`` yields
        StreamOutputs (new token ids, a text delta; the last has ``finished`` and the whole ``output``). It joins
        whatever batch is running. Raises ValueError if the request is refused."""
        ids, error = streams.check_prompt(self.loop, prompt, sampling_params or SamplingParams())
        if error:
            raise ValueError(error)
        return streams.RequestStream(self.loop, ids, streams.as_params(sampling_params or SamplingParams()),
                                     request_id)

    def abort(self, request_id: str) -> None:
        """End a streaming request early (its pages are freed at the next step boundary)."""
        self.loop.abort(request_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt page (prefix caching), between steps: the next requests prefill from their
        first token (benchmarks' cold runs). Pages in use stay with their requests."""
        self.loop.call(self.engine.prefix_cache.reset)

    def warmup(self, logprobs: Sequence[int] = ()) -> int:
        """Compile and capture now, not on a request's path: every batch bucket's CUDA graph for greedy, sampled
        and seeded sampled requests (FlashInfer's sampling build comes with the first sampled capture), and for
        each number of ``logprobs`` given. Returns the graphs held (0 without CUDA graphs)."""
        widths = [logprobs_width([n]) for n in logprobs]
        examples = [variant_example(v) for v in WARMUP_VARIANTS] + [variant_example((True, False, w)) for w in widths]
        return self.loop.call(lambda: self._capture(examples))

    def _capture(self, examples: list[SamplingParams]) -> int:
        self.runner.prepare_graphs(examples)
        return len(self.runner.graph_runner.graphs) if self.runner.graph_runner is not None else 0

    @property
    def engine(self) -> Engine:
        return self.loop.engine

    @property
    def async_engine(self) -> AsyncEngine:
        """The asyncio face of this model's engine: ``async for out in model.async_engine.generate(...)``."""
        return AsyncEngine(self.loop)

    @property
    def runner(self) -> ModelRunner:
        return self.engine.runner

    @property
    def tokenizer(self):
        return self.runner.tokenizer

    @property
    def target(self) -> TargetModel:
        return self.runner.target

    @property
    def worker(self) -> SpecWorkerBase:
        return self.runner.worker

    @property
    def mode(self) -> SpeculativeDecodingMode:
        return self.runner.model.mode

    @property
    def max_draft_len(self) -> int:
        return self.runner.max_draft_len

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def decode(self, token_ids: list[int]) -> str | None:
        return self.engine.decode(token_ids)


def _close(loop: EngineLoop) -> None:
    if not loop.close():
        log.warning("the engine's thread did not stop within 10 s; its CUDA graphs are kept")
        return
    loop.engine.runner.release_graphs()


def _close_at_exit(loop: weakref.ref[EngineLoop]) -> None:
    alive = loop()
    if alive is not None:
        _close(alive)
