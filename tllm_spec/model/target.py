"""TargetModel: a stock Hugging Face causal LM run on a packed batch through tllm_spec attention.

Supported dense architectures run through :class:`~tllm_spec.model.decoder.FusedDecoder` (fused q/k/v and gate/up
GEMMs, weights shared with the stock modules) once :meth:`TargetModel.fuse` is called; anything else, or a
target left unfused, runs the stock HF decoder modules with our attention behind transformers'
``AttentionInterface``.

Tensor parallel (a :class:`~tllm_spec.distributed.parallel.TensorParallel` given): each rank holds its shards
(:mod:`tllm_spec.distributed.sharding`) and runs the fused decoder, whose attention and MLP all-reduce their outputs; the
lm_head is vocabulary-parallel and the sampled rows' logits are gathered once."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel

from ..distributed.parallel import TensorParallel, check_shardable, gather_vocab
from ..distributed.sharding import load_sharded, random_sharded
from .attention import ATTN_IMPLEMENTATION, AttentionMetadata
from .decoder import FusedDecoder
from .layers import COMPILE_OPTIONS, linear
from .quant import checkpoint as quant_checkpoint
from .quant.linear import quantize_linears


class TargetModel(nn.Module):
    """Wraps ``AutoModelForCausalLM`` without forking it: the decoder runs with explicit positions and
    ``use_cache=False``; K/V go to our paged cache; logits are computed only where asked.

    Forward hooks capture the outputs of chosen decoder layers (EAGLE-3's aux hidden states).
    """

    def __init__(self, hf_model: PreTrainedModel, parallel: TensorParallel | None = None):
        super().__init__()
        self.parallel = parallel
        self.hf = hf_model.requires_grad_(False)  # inference only (draft training freezes the target too)
        self.config = hf_model.config
        self.decoder = hf_model.get_decoder()
        self.lm_head = hf_model.get_output_embeddings()
        self.vocab_size: int = hf_model.config.vocab_size if parallel else self.lm_head.weight.shape[0]
        self._captured: dict[int, torch.Tensor] = {}
        self._capture_ids: tuple[int, ...] = ()
        self.fused: FusedDecoder | None = None
        self._fused_compiled = None  # torch.compile of fused.forward, for generation-only (graphed) steps
        self.compiled = False
        self.checkpoint_dir: Path | None = None  # set by load(); MTP weights are read from here

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype, device: torch.device,
             parallel: TensorParallel | None = None, quantization: str | None = None) -> TargetModel:
        """``parallel``: load only this rank's shards (checked to fit before any weight is read). An FP8 checkpoint
        (its config says which format: :mod:`.quant.checkpoint`) loads as FP8; ``quantization="fp8"`` quantizes a
        higher-precision checkpoint's linear layers (the lm_head stays) on the way to ``device``."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: not a Hugging Face model directory (no config.json)")
        config = AutoConfig.from_pretrained(path)
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError(f"{path}: encoder-decoder models are not supported; tllm_spec needs a causal LM")
        check_quantization(quantization)
        scheme = quant_checkpoint.scheme_of(path, config)
        if scheme is not None or quantization:
            _refuse_fp8_moe(config, f"{path}: ")
        if parallel is not None:
            if scheme is not None:
                raise NotImplementedError(f"{path}: an FP8 checkpoint ({scheme.name}) with tensor parallelism is not "
                                          "supported yet; quantization='fp8' on a bf16 checkpoint is")
            target = cls(_sharded(config, parallel, lambda: load_sharded(path, config, dtype, device, parallel)),
                         parallel)
            if quantization:
                quantize_linears(target.hf, device=device)
            target.hf.generation_config = _generation_config(path, target.hf.generation_config)
            target.checkpoint_dir = path
            return target
        if scheme is not None:
            hf = quant_checkpoint.load(path, config, dtype, scheme)
            hf.generation_config = _generation_config(path, hf.generation_config)
        else:
            hf = _load_complete(path, dtype)
            if quantization:
                quantize_linears(hf, device=device)
        target = cls(hf.to(device).eval())
        target.checkpoint_dir = path
        return target

    @classmethod
    def from_config(cls, config: PretrainedConfig, dtype: torch.dtype, device: torch.device | str,
                    seed: int = 0, parallel: TensorParallel | None = None) -> TargetModel:
        """A randomly initialised target built directly on ``device`` (benchmarks, no checkpoint needed);
        ``parallel``: only this rank's shards."""
        if parallel is not None:
            device = torch.device(device)
            return cls(_sharded(config, parallel, lambda: random_sharded(config, dtype, device, parallel, seed)),
                       parallel)
        torch.manual_seed(seed)
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        return cls(hf.eval())

    def quantize(self, quantization: str | None) -> TargetModel:
        """Online quantization of an already built target (a random benchmark target): ``"fp8"`` replaces its
        linear layers, the lm_head excepted, by FP8 ones (:func:`~.quant.linear.quantize_linears`); before
        :meth:`fuse`. None: unchanged."""
        check_quantization(quantization)
        if quantization:
            _refuse_fp8_moe(self.config, "")
            if self.fused is not None:
                raise RuntimeError("quantize the target before fusing its layers")
            quantize_linears(self.hf)
        return self

    def fuse(self, max_positions: int) -> bool:
        """Switch to the fused decoder (RoPE table for positions < ``max_positions``); False when the
        architecture is not supported (the stock modules stay in use)."""
        if self.fused is None:
            self.fused = FusedDecoder.from_hf(self.hf, max_positions,
                                              self.parallel.group_name if self.parallel else None)
            if self.fused is not None:
                self.fused.capture_ids = self._capture_ids
        elif self.fused.rotary.max_positions < max_positions:
            self.fused.rotary.resize(max_positions)
        return self.fused is not None

    def place_kv_layers(self, first: int) -> None:
        """Write K/V to cache layers ``first``, ``first + 1``, ... instead of 0, 1, ...: a draft LM's layers sit
        after the target's in one KV pool (stock and fused layers alike; before :meth:`fuse`)."""
        for i, layer in enumerate(self.decoder.layers):
            layer.self_attn.layer_idx = first + i

    @property
    def decoder_layer_class(self) -> type[nn.Module]:
        """The stock HF decoder-layer class (MTP blocks are built from it)."""
        return type(self.decoder.layers[0])

    def compile(self) -> None:
        """torch.compile the decoder with dynamic shapes (one compilation serves every batch bucket above 1, batch
        1 has its own: its layers take the few-row kernels, ``layers.few_row_kernels``): the fused
        decoder whole, for generation-only steps (prompts keep the eager path: their lengths vary); the stock
        modules layer by layer."""
        if self.fused is not None:
            self._fused_compiled = self._fused_compiled or torch.compile(self.fused.forward, dynamic=True,
                                                                             options=COMPILE_OPTIONS)
            return
        if self.compiled:
            return
        for i, layer in enumerate(self.decoder.layers):
            self.decoder.layers[i] = torch.compile(layer, dynamic=True)
        self.compiled = True

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def kv_scales(self) -> list[tuple[float, float]] | None:
        """Per-layer (k_scale, v_scale) an FP8 checkpoint gives its KV cache (None: none given)."""
        return getattr(self.hf, "tllm_kv_scales", None)

    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of every decoder layer, in order (this rank's KV heads when tensor parallel)."""
        head_dim = getattr(self.config, "head_dim", None) or self.hidden_size // self.config.num_attention_heads
        num_kv_heads = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
        if self.parallel is not None:
            start, stop = self.parallel.kv_heads(num_kv_heads)
            num_kv_heads = stop - start
        return [(num_kv_heads, head_dim)] * self.num_layers

    def capture_layers(self, layer_ids: tuple[int, ...]) -> None:
        """Capture the outputs of these decoder layers on every forward (ids are 0-based, may repeat)."""
        for i in sorted(set(layer_ids)):
            if not 0 <= i < self.num_layers:
                raise ValueError(f"cannot capture layer {i}: the target has {self.num_layers} decoder layers")
            self.decoder.layers[i].register_forward_hook(self._make_hook(i))
        self._capture_ids = tuple(layer_ids)
        if self.fused is not None:
            self.fused.capture_ids = self._capture_ids

    def _make_hook(self, layer: int):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
            self._captured[layer] = output[0] if isinstance(output, tuple) else output
        return hook

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, attn: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A packed batch: input_ids [T] int64 -> (final-normed hidden [T, H], the capture layers' outputs
        concatenated low -> high layer [T, n*H], or None when no layer is captured)."""
        if self.fused is not None:
            use_compiled = self._fused_compiled is not None and not attn.context_lens
            hidden, captured = (self._fused_compiled if use_compiled else self.fused)(input_ids, attn)
        else:
            out = self.decoder(input_ids=input_ids[None], position_ids=attn.rotary_positions[None], use_cache=False,
                               tllm_attn=attn)
            hidden, captured = out.last_hidden_state[0], [self._captured[i][0] for i in self._capture_ids]
        return hidden, torch.cat(captured, dim=-1) if captured else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, H] -> [R, V] in fp32 (tensor parallel: this rank's vocabulary slice, gathered from all ranks)."""
        logits = linear(hidden, self.lm_head)
        if self.parallel is not None:
            logits = gather_vocab(logits, self.vocab_size, self.parallel)
        return logits.float()


QUANTIZATIONS = ("fp8",)


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not supported; give one of {list(QUANTIZATIONS)} or None")


def _refuse_fp8_moe(config: PretrainedConfig, where: str) -> None:
    """FP8 (a checkpoint or online) is refused for mixture-of-experts targets, in one line."""
    if is_moe_config(config):
        raise NotImplementedError(f"{where}FP8 mixture-of-experts targets are not supported yet (the experts' FP8 "
                                  "path is a later addition); load a bf16 checkpoint without quantization")


def is_moe_config(config: PretrainedConfig) -> bool:
    """Whether a config describes a mixture-of-experts model (any expert count field above 1)."""
    return any((getattr(config, key, None) or 0) > 1 for key in ("num_experts", "num_local_experts",
                                                                 "n_routed_experts"))


def max_positions(config: PretrainedConfig) -> int | None:
    """The longest sequence the target's positions were made for: ``max_position_embeddings``, or the length a RoPE
    scaling stretches it to (``factor`` times ``original_max_position_embeddings``, else times
    ``max_position_embeddings``, as vLLM derives it; llama3 and longrope configs state the stretched length
    themselves). None when the config names no limit."""
    limit = getattr(config, "max_position_embeddings", None)  # HF configs differ by architecture
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    nested = rope and all(isinstance(v, dict) for v in rope.values())  # one set per layer type (Gemma 3)
    lengths = [limit, *(_scaled_length(params, limit) for params in (rope.values() if nested else [rope]))]
    return max((n for n in lengths if n is not None), default=None)


def _scaled_length(rope: dict, max_position_embeddings: int | None) -> int | None:
    """The positions a RoPE scaling of ``rope_type`` linear, dynamic or yarn reaches; None for the others."""
    factor, base = rope.get("factor"), rope.get("original_max_position_embeddings") or max_position_embeddings
    if rope.get("rope_type", rope.get("type")) in (None, "default", "llama3", "longrope") or \
            not isinstance(factor, int | float) or not base:
        return None
    return int(base * factor)


def check_max_seq_len(config: PretrainedConfig, max_seq_len: int | None) -> None:
    """Refuse a ``max_seq_len`` past :func:`max_positions` of a checkpoint's config: the positions beyond were never
    trained, and the KV pool and RoPE table would be sized for them."""
    limit = max_positions(config)
    if max_seq_len is not None and limit is not None and max_seq_len > limit:
        raise ValueError(f"max_seq_len={max_seq_len} is more than the {limit} positions the target was made for "
                         f"(max_position_embeddings in its config.json, stretched by any rope scaling there); give "
                         f"at most {limit}")


def _refuse_missing_weights(path: Path, missing: list[str], unexpected: set[str]) -> None:
    """A checkpoint that leaves a weight randomly initialised is not the model the user meant."""
    if not missing:
        return
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    head = "fc.weight" in unexpected or any(name.startswith("midlayer.") for name in unexpected)
    hint = ("; it holds an EAGLE-3 head (fc.weight, midlayer.*), a draft for a target, not a target" if head else
            "; a target checkpoint must hold every weight of its architecture")
    raise ValueError(f"{path}: the checkpoint lacks {len(missing)} of the target's weights, which would be randomly "
                     f"initialised ({shown}){hint}")


def _load_complete(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """``from_pretrained``, refusing a checkpoint that leaves any weight randomly initialised. transformers' load
    report (a table of missing and unused tensors, logged as a warning) is held back until the check: a refused
    checkpoint is told in one line, by the error; any other keeps its report."""
    logger, held, info = logging.getLogger("transformers.modeling_utils"), [], None
    hold = held.append  # as a filter it returns None: the record is kept here, not logged
    logger.addFilter(hold)
    try:
        hf, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
                                                        output_loading_info=True)
    finally:
        logger.removeFilter(hold)
        for record in held if info is None or not info["missing_keys"] else ():
            logger.callHandlers(record)
    _refuse_missing_weights(path, sorted(info["missing_keys"]), info["unexpected_keys"])
    return hf


def _sharded(config: PretrainedConfig, parallel: TensorParallel, build) -> PreTrainedModel:
    """``build()`` once ``config`` is known to split ``parallel.size`` ways through the fused layers."""
    check_shardable(config, parallel.size)
    with torch.device("meta"):
        probe = AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION)
    if not FusedDecoder.supports(probe):
        raise ValueError(f"tensor parallelism runs the fused decoder layers, which do not support "
                         f"{type(probe).__name__}; use tensor_parallel_size=1")
    return build().requires_grad_(False).eval()


def _generation_config(path: Path, default: GenerationConfig) -> GenerationConfig:
    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return default
