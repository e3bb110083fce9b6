"""FP8 checkpoints: which format a checkpoint is (from its own config), and loading it as Fp8Linear layers.

Each format is one parser from its config to an :class:`Fp8Scheme` (:data:`PARSERS`: compressed-tensors, Hugging
Face fine-grained ``fp8``, ``fbgemm_fp8``, NVIDIA ModelOpt); one loader then reads any of them: a linear layer
is FP8 exactly when the checkpoint stores its weight as ``float8_e4m3fn`` (so the formats' ``ignore`` /
``modules_to_not_convert`` lists are honoured as the checkpoint honoured them: those weights are stored in 16 bits
and load as they are), its scales become the layer's channel (a per-tensor scale: N equal ones) or block scales.
Any other quantization method or scheme (NVFP4, int4 AWQ/GPTQ, bitsandbytes, weight-only FP8) is refused in one
line that names it: a model is loaded as the checkpoint means it or not at all.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from ...distributed.sharding import meta_model, rebuild_meta_buffers, weight_files
from ...kernels.fp8_linear import GROUP
from .linear import Fp8Linear

SUPPORTED = ("compressed-tensors (float-quantized / naive-quantized FP8, tensor / channel / block scales), "
             "fp8 (fine-grained, 128x128 blocks), fbgemm_fp8, modelopt (FP8)")


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's FP8 linear layers compute."""

    name: str  # the format, as its users know it
    block_scales: bool = False  # 128 x 128 weight blocks; activations per token and 128 columns
    static_input: bool = False  # one stored ``input_scale`` per layer; else dynamic per token
    scale_ub: float | None = None  # fbgemm: the per-token activation maximum is clamped to this first
    scale_key: str = "weight_scale"  # the weight scale's tensor name (``weight_scale_inv``: fine-grained)


class UnsupportedQuantization(NotImplementedError):
    pass


def _refuse(path: Path, what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"{path}: {what} is not supported; tllm_spec loads {SUPPORTED}")


def _compressed_tensors(qc: dict, path: Path) -> Fp8Scheme:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(path, f"compressed-tensors format {fmt!r}")
    schemes = set()
    for name, group in (qc.get("config_groups") or {}).items():
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise _refuse(path, f"compressed-tensors group {name!r} with {weights.get('num_bits')}-bit "
                                f"{weights.get('type')} weights")
        if inputs is None:
            raise _refuse(path, f"compressed-tensors group {name!r}: weight-only FP8 (no activation quantization)")
        strategy, act = weights.get("strategy"), inputs.get("strategy")
        block = strategy == "block"
        if block and (weights.get("block_structure") not in ([GROUP, GROUP], None) or act != "group"
                      or inputs.get("group_size") != GROUP):
            raise _refuse(path, f"compressed-tensors group {name!r}: block scales other than {GROUP}x{GROUP} "
                                f"weights with per-token {GROUP}-column activations")
        if strategy not in ("tensor", "channel", "block") or act not in ("tensor", "token", "group") or \
                bool(inputs.get("dynamic")) == (act == "tensor") or (act == "group") != block:
            raise _refuse(path, f"compressed-tensors group {name!r}: {strategy} weight scales with "
                                f"{'dynamic' if inputs.get('dynamic') else 'static'} {act} activation scales")
        schemes.add((block, act == "tensor"))
    if len(schemes) != 1:
        raise _refuse(path, f"compressed-tensors with {len(schemes)} different FP8 schemes")
    block, static = schemes.pop()
    return Fp8Scheme("compressed-tensors", block_scales=block, static_input=static)


def _fine_grained(qc: dict, path: Path) -> Fp8Scheme:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(path, f"fp8 with activation_scheme {qc.get('activation_scheme')!r}")
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme("fp8 (per tensor)", scale_key="weight_scale_inv")
    if list(block) != [GROUP, GROUP]:
        raise _refuse(path, f"fp8 with weight_block_size {block}")
    return Fp8Scheme("fp8 (fine-grained)", block_scales=True, scale_key="weight_scale_inv")


def _fbgemm(qc: dict, path: Path) -> Fp8Scheme:
    ub = qc.get("activation_scale_ub")
    return Fp8Scheme("fbgemm_fp8", scale_ub=None if ub is None else float(ub))


def _modelopt(qc: dict, path: Path) -> Fp8Scheme:
    algo = qc.get("quant_algo")
    if algo == "FP8":
        return Fp8Scheme("modelopt FP8", static_input=True)
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return Fp8Scheme("modelopt FP8 per channel")
    raise _refuse(path, f"modelopt quant_algo {algo!r}")


PARSERS = {"compressed-tensors": _compressed_tensors, "fp8": _fine_grained, "fbgemm_fp8": _fbgemm,
           "modelopt": _modelopt}


def scheme_of(path: Path, config: PretrainedConfig) -> Fp8Scheme | None:
    """The checkpoint's FP8 scheme from its ``quantization_config`` (or ModelOpt's ``hf_quant_config.json``); None
    for an unquantized checkpoint; :class:`UnsupportedQuantization` for anything else."""
    qc = getattr(config, "quantization_config", None)
    if qc is None and (path / "hf_quant_config.json").is_file():
        qc = {"quant_method": "modelopt", **json.loads((path / "hf_quant_config.json").read_text())["quantization"]}
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method == "modelopt" and "quant_algo" not in qc and isinstance(qc.get("quantization"), dict):
        qc = {**qc, **qc["quantization"]}
    if method not in PARSERS:
        raise _refuse(path, f"quantization method {method!r}")
    return PARSERS[method](qc, path)


def load(path: Path, config: PretrainedConfig, dtype: torch.dtype, scheme: Fp8Scheme) -> PreTrainedModel:
    """The checkpoint at ``path`` on the CPU: its FP8 linear layers as :class:`Fp8Linear`, every other tensor in
    ``dtype``. A tensor the model needs and the checkpoint lacks is refused, as for any target."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    hf = meta_model(config, dtype)
    files = weight_files(path)
    handles: dict[str, object] = {}

    def handle(name: str):
        if files[name] not in handles:
            handles[files[name]] = safe_open(str(path / files[name]), framework="pt", device="cpu")
        return handles[files[name]]

    def read(name: str) -> torch.Tensor:
        return handle(name).get_tensor(name)

    for name, module in list(hf.named_modules()):
        key = f"{name}.weight"
        if isinstance(module, nn.Linear) and key in files and handle(key).get_slice(key).get_dtype() == "F8_E4M3":
            parent, _, attr = name.rpartition(".")
            setattr(hf.get_submodule(parent) if parent else hf, attr, _fp8_linear(name, module, scheme, read, files,
                                                                                  dtype, path))
    missing = []
    for module_name, module in hf.named_modules():
        if isinstance(module, Fp8Linear):
            continue
        for param_name, param in list(module._parameters.items()):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if param is None or not param.is_meta:
                continue
            if name not in files:
                missing.append(name)
                continue
            module._parameters[param_name] = nn.Parameter(read(name).to(dtype), requires_grad=False)
        for buffer_name, buffer in list(module._buffers.items()):
            name = f"{module_name}.{buffer_name}"
            if buffer is not None and buffer.is_meta and buffer_name not in module._non_persistent_buffers_set:
                if name not in files:
                    missing.append(name)
                    continue
                module._buffers[buffer_name] = read(name).to(buffer.dtype)
    if config.tie_word_embeddings and "lm_head.weight" in missing:
        missing.remove("lm_head.weight")
        hf.get_output_embeddings().weight = hf.get_input_embeddings().weight
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} of the target's weights, which would be "
                         f"randomly initialised ({shown})")
    rebuild_meta_buffers(hf, config, torch.device("cpu"))
    hf.tllm_kv_scales = _kv_scales(files, read, config.num_hidden_layers)
    return hf


def _kv_scales(files: dict, read, num_layers: int) -> list[tuple[float, float]] | None:
    """Each decoder layer's per-tensor (k_scale, v_scale) for an FP8 KV cache, where the checkpoint stores them
    (``self_attn.k_scale`` / ``v_scale``, or the older ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale``); 1.0
    for a layer without; None for a checkpoint without any."""
    def scale(layer: int, kind: str) -> float | None:
        for key in (f"model.layers.{layer}.self_attn.{kind}_scale", f"model.layers.{layer}.self_attn.{kind}_proj."
                                                                    f"{kind}_scale"):
            if key in files:
                return float(read(key).float().max())
        return None

    scales = [(scale(i, "k"), scale(i, "v")) for i in range(num_layers)]
    if all(k is None and v is None for k, v in scales):
        return None
    return [(k or 1.0, v or 1.0) for k, v in scales]


def _fp8_linear(name: str, module: nn.Linear, scheme: Fp8Scheme, read, files: dict, dtype: torch.dtype,
                path: Path) -> Fp8Linear:
    """The Fp8Linear of layer ``name`` from its checkpoint tensors (weight, scale, input scale, bias)."""
    def tensor(suffix: str, required: bool = True) -> torch.Tensor | None:
        key = f"{name}.{suffix}"
        if key in files:
            return read(key)
        if required:
            raise ValueError(f"{path}: {key} is missing ({scheme.name}: the FP8 weight {name}.weight needs it)")
        return None

    weight, scale = tensor("weight"), tensor(scheme.scale_key).float()
    rows = weight.shape[0]
    if not scheme.block_scales:
        if scale.numel() == 1:
            scale = scale.reshape(1).expand(rows).contiguous()  # per tensor: N equal channel scales
        elif scale.numel() == rows:
            scale = scale.reshape(rows)
        else:
            raise ValueError(f"{path}: {name}.{scheme.scale_key} has shape {list(scale.shape)}; {scheme.name} "
                             f"expects one scale or one per output channel ({rows})")
    input_scale = tensor("input_scale", required=scheme.static_input) if scheme.static_input else None
    bias = tensor("bias", required=module.bias is not None) if module.bias is not None else None
    try:
        return Fp8Linear(weight, scale, None if bias is None else bias.to(dtype), input_scale, scheme.block_scales,
                         scheme.scale_ub)
    except ValueError as exc:
        raise ValueError(f"{path}: {name}: {exc}") from None
