"""FusedDecoder: the target's decoder stack rebuilt from the stock HF modules with fused projections.

Covers the dense Llama family the README names (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms,
Mistral with a sliding window), the mixture-of-experts families of :mod:`tllm_spec.model.moe` (Qwen3-MoE, Mixtral,
GLM-4.5 with its partial rotary embedding) and any checkpoint whose modules have the same shape; other
architectures return ``None`` from :meth:`FusedDecoder.from_hf` and run through the stock HF modules instead
(except MoE ones, which :func:`refuse_unsupported_moe` refuses: their stock expert loop synchronises with the host).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from .. import trace_cache
from .attention import AttentionMetadata
from .kv_cache import KVCache
from .layers import COMPILE_OPTIONS, MLP, Attention, DecoderLayer
from .moe import MoE
from .moe import unsupported as unsupported_moe
from .rotary import RotaryTable

_RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "Qwen3MoeRMSNorm", "MixtralRMSNorm",
              "Glm4MoeRMSNorm")  # x̂·w, eps in fp32
_SLIDING_FROM_CONFIG = ("MistralAttention", "MixtralAttention")  # their window is read from the config
_ATTENTION_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_KEYS = ("gate_proj", "up_proj", "down_proj")


class FusedDecoder(nn.Module):
    """embed -> layers -> final norm over a packed batch, capturing chosen layers' outputs on the way.

    Shares the embedding, norms and weights (as views) with the stock HF model it was built from.
    """

    def __init__(self, embed_tokens: nn.Module, layers: list[DecoderLayer], norm: nn.Module, rotary: RotaryTable):
        super().__init__()
        self.embed_tokens, self.norm, self.rotary = embed_tokens, norm, rotary
        self.layers = nn.ModuleList(layers)
        self.capture_ids: tuple[int, ...] = ()
        self._compiled: dict[str, list[Callable]] = {}  # backend -> each layer through one compiled function
        self._bound_cache: KVCache | None = None  # the KV cache the layers' attention tensors belong to

    @staticmethod
    def supports(hf_model: PreTrainedModel) -> bool:
        """Whether ``hf_model``'s layers are the supported dense kind (works on a meta-device model too)."""
        decoder = hf_model.get_decoder()
        return (all(_supported_layer(layer) for layer in decoder.layers)
                and _supported_rotary(getattr(decoder, "rotary_emb", None))
                and type(decoder.norm).__name__ in _RMS_NORMS)

    @classmethod
    def from_hf(cls, hf_model: PreTrainedModel, max_positions: int, tp_group: str | None = None
                ) -> FusedDecoder | None:
        """Fuse ``hf_model``'s decoder, or None when its layers are not the supported dense kind. ``tp_group``:
        the model holds one tensor-parallel rank's shards; attention and MLP outputs are all-reduced there."""
        if not cls.supports(hf_model):
            return None
        decoder = hf_model.get_decoder()
        dtype = decoder.embed_tokens.weight.dtype
        # each layer writes the KV layer its stock attention names (a draft LM's come after the target's)
        layers = [_fuse_layer(layer, layer.self_attn.layer_idx) for layer in decoder.layers]
        for layer in layers:
            layer.self_attn.tp_group = layer.mlp.tp_group = tp_group
        return cls(decoder.embed_tokens, layers, decoder.norm,
                   RotaryTable.from_hf(decoder.rotary_emb, max_positions, dtype))

    def forward(self, input_ids: torch.Tensor, attn: AttentionMetadata) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids [T] int64 -> (final-normed hidden [T, H], outputs of the capture layers, each [T, H]).

        Under torch.compile the layers run one compiled layer each (:meth:`_compiled_layers`): one compilation
        serves all of them, where tracing the whole stack would trace every layer again (most of a start-up)."""
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary(attn.rotary_positions)
        if torch.compiler.is_compiling():
            hidden, captured = self._compiled_layers(hidden, rope, attn)
        else:
            hidden, captured = run_layers(self.layers, self.capture_ids, hidden, rope, attn)
        return self.norm(hidden), captured

    @torch.compiler.disable  # the caller's graph stops here; each layer below is a compiled region of its own
    def _compiled_layers(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata
                         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        backend = _layer_backend[0]
        if backend not in self._compiled:  # one compiled function for all layers, the layer an argument: one
            # torch.compile wrapper, so a second process loads the layers' traces once (trace_cache.py)
            options = COMPILE_OPTIONS if backend == "inductor" else None
            layer_forward = trace_cache.compile_inside(_layer_forward, dynamic=True, backend=backend,
                                                       options=options)
            self._compiled[backend] = [functools.partial(layer_forward, layer) for layer in self.layers]
        return run_layers(self._compiled[backend], self.capture_ids, hidden, rope, attn)

    def bind_kv_cache(self, kv_cache: KVCache) -> None:
        """Each layer attends over its own layer of ``kv_cache`` as tensors (see :meth:`Attention.bind_kv_cache`).
        Engines that share this target (each with its cache) bind theirs before each of their steps; a no-op
        while the cache stays the same."""
        if self._bound_cache is kv_cache:
            return
        for layer in self.layers:
            attn = layer.self_attn
            attn.bind_kv_cache(kv_cache.k[attn.kv_layer], kv_cache.v[attn.kv_layer], kv_cache.scales(attn.kv_layer))
        self._bound_cache = kv_cache


_layer_backend = ["inductor"]  # the torch.compile backend of the layers of a compiled step (layer_backend)


@contextlib.contextmanager
def layer_backend(backend: str) -> Iterator[None]:
    """Compile the fused layers with ``backend`` (as the step that calls them is) inside this block."""
    saved, _layer_backend[0] = _layer_backend[0], backend
    try:
        yield
    finally:
        _layer_backend[0] = saved


def _layer_forward(layer: nn.Module, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   attn: AttentionMetadata) -> torch.Tensor:
    return layer(hidden, rope, attn)


def run_layers(layers, capture_ids: tuple[int, ...], hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               attn: AttentionMetadata) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """hidden [T, H] through ``layers`` -> (hidden [T, H], the outputs of the layers in ``capture_ids``)."""
    captured = {}
    for i, layer in enumerate(layers):
        hidden = layer(hidden, rope, attn)
        if i in capture_ids:
            captured[i] = hidden
    return hidden, [captured[i] for i in capture_ids]


def _supported_layer(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or not all(isinstance(getattr(attn, k, None), nn.Linear) for k in _ATTENTION_KEYS):
        return False
    if not (_is_moe(mlp) and unsupported_moe(mlp) is None or _dense_mlp(mlp)):
        return False
    norms = [layer.input_layernorm, layer.post_attention_layernorm] + [
        getattr(attn, k) for k in ("q_norm", "k_norm") if getattr(attn, k, None) is not None]
    children = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
    return set(type(n).__name__ for n in norms) <= set(_RMS_NORMS) and set(dict(layer.named_children())) == children


def _dense_mlp(mlp: nn.Module) -> bool:
    return (all(isinstance(getattr(mlp, k, None), nn.Linear) for k in _MLP_KEYS)
            and type(getattr(mlp, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"))


def _is_moe(mlp: nn.Module) -> bool:
    return getattr(mlp, "experts", None) is not None


def is_moe(hf_model: PreTrainedModel) -> bool:
    """Whether any decoder layer of ``hf_model`` is a mixture of experts."""
    return any(_is_moe(getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None) or nn.Module())
               for layer in hf_model.get_decoder().layers)


def refuse_unsupported_moe(hf_model: PreTrainedModel) -> None:
    """Refuse, in one line naming what is missing, a mixture-of-experts target the fused path cannot run: its
    stock expert loop synchronises with the host on every layer, which a graphed step cannot do (and MoE models
    are the ones too large to run that slowly). MLA attention (DeepSeek-V3) is named as such."""
    config = hf_model.config
    if getattr(config, "kv_lora_rank", None):
        raise NotImplementedError(f"{config.model_type}: MLA attention (kv_lora_rank) is not supported (the fused "
                                  "path runs q/k/v attention; MLA is a later addition)")
    decoder = hf_model.get_decoder()
    for i, layer in enumerate(decoder.layers):
        mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        if mlp is None or not _is_moe(mlp):
            continue
        reason = unsupported_moe(mlp)
        if reason is None and not _supported_layer(layer):
            extra = sorted(set(dict(layer.named_children())) - {"self_attn", "mlp", "input_layernorm",
                                                                 "post_attention_layernorm"})
            reason = (f"{type(layer).__name__}: its attention or norms are not the supported kind"
                      + (f" (extra modules {extra})" if extra else ""))
        if reason is None and not _supported_rotary(getattr(decoder, "rotary_emb", None)):
            reason = f"rotary embedding {getattr(decoder.rotary_emb, 'rope_type', None)!r} is not supported"
        if reason is not None:
            raise NotImplementedError(f"{type(hf_model).__name__} layer {i}: mixture-of-experts target not supported: "
                                      f"{reason}")


def _supported_rotary(rotary: nn.Module | None) -> bool:
    return rotary is not None and getattr(rotary, "rope_type", None) in RotaryTable.STATIC_ROPE_TYPES


def fused_layer(layer: nn.Module, index: int, rotary: nn.Module | None) -> DecoderLayer | None:
    """One stock decoder layer (writing KV layer ``index``) as a fused layer, or None when the layer or its
    rotary embedding is not a supported kind (an MTP module's block)."""
    return _fuse_layer(layer, index) if _supported_layer(layer) and _supported_rotary(rotary) else None


def _fuse_layer(layer: nn.Module, index: int) -> DecoderLayer:
    attn, mlp = layer.self_attn, layer.mlp
    window = getattr(attn, "sliding_window", None)
    if window is None and type(attn).__name__ in _SLIDING_FROM_CONFIG:
        window = getattr(attn.config, "sliding_window", None)
    fused_attn = Attention.from_linears(attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, attn.head_dim, index,
                                        attn.scaling, sliding_window=window, q_norm=getattr(attn, "q_norm", None),
                                        k_norm=getattr(attn, "k_norm", None))
    return DecoderLayer(layer.input_layernorm, fused_attn, layer.post_attention_layernorm,
                        MoE.from_hf(mlp) if _is_moe(mlp) else MLP.from_linears(mlp.gate_proj, mlp.up_proj,
                                                                                mlp.down_proj))
