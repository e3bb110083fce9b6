"""A tensor-parallel rank's part of a Hugging Face target: the stock model built on the meta device, then each
parameter materialised as this rank's shard, read from safetensors slices (``safe_open(...).get_slice``: a
rank never holds the whole checkpoint in host memory) or drawn at random (benchmarks).

What is split (Megatron layout): q/k/v and gate/up by output rows (column-parallel: heads, intermediate),
o/down by input columns (row-parallel: their outputs are partial sums, all-reduced by the fused layers),
lm_head by vocabulary rows; mixture-of-experts layers as :mod:`.experts` says (every expert's slice of its
intermediate dimension, the router whole). Everything else (embedding, norms) is whole on every rank. KV heads
are split, or replicated when there are fewer of them than ranks. A row-parallel bias is kept on rank 0 only
(added once by the all-reduce).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from .experts import Shard, disk_reads, expert_shard, num_experts
from .parallel import TensorParallel

_COLUMN = re.compile(r"\.(self_attn\.(?P<attn>[qkv])_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.(?P<kind>weight|bias)$")
LM_HEAD = "lm_head.weight"


def shard_of(name: str, config: PretrainedConfig, parallel: TensorParallel) -> Shard | None:
    """This rank's part of the parameter ``name`` (HF state-dict key); None = the whole tensor."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if name == LM_HEAD:
        rows = parallel.padded_vocab(config.vocab_size)
        return Shard(0, parallel.rank * rows, (parallel.rank + 1) * rows)
    experts = expert_shard(name, config, parallel.split)
    if experts is not False:
        return experts
    column = _COLUMN.search(name)
    if column:
        which = column.group("attn")
        if which in ("k", "v"):
            start, stop = parallel.kv_heads(kv_heads)
        elif which == "q":
            start, stop = parallel.split(heads)
        else:
            start, stop = parallel.split(config.intermediate_size)
            return Shard(0, start, stop)
        return Shard(0, start * head_dim, stop * head_dim)
    row = _ROW.search(name)
    if row is None:
        return None
    total = heads * head_dim if "o_proj" in name else config.intermediate_size
    if row.group("kind") == "bias":
        return Shard(0, 0, config.hidden_size, zero=not parallel.is_first)
    return Shard(1, *parallel.split(total))


def load_sharded(path: Path, config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                 parallel: TensorParallel) -> PreTrainedModel:
    """This rank's shard of the checkpoint at ``path`` (safetensors, one file or an index of files)."""
    files = weight_files(path)
    hf = meta_model(config, dtype)
    handles: dict[str, object] = {}

    def read_one(name: str, shard: Shard | None) -> torch.Tensor:
        if name not in files:
            raise ValueError(f"{path}: tensor {name!r} is missing from the safetensors files")
        if files[name] not in handles:
            handles[files[name]] = safe_open(str(path / files[name]), framework="pt", device="cpu")
        part = handles[files[name]].get_slice(name)
        if shard is None:
            return part[:]
        before = (slice(None),) * shard.dim
        return torch.cat([part[(*before, slice(a, b))] for a, b in shard.ranges(part.get_shape()[shard.dim])],
                         dim=shard.dim)

    def read(name: str, shard: Shard | None, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        try:
            reads = disk_reads(name, shard, files, num_experts(config))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        if reads is None:
            tensor = read_one(name, shard)
        elif len(reads) == 1:  # the same tensor under another name
            tensor = read_one(*reads[0])
        else:  # one tensor per expert and projection: gate|up rows per expert, then the experts stacked
            per_expert = len(reads) // num_experts(config)
            parts = [read_one(*r) for r in reads]
            tensor = torch.stack([torch.cat(parts[i:i + per_expert]) for i in range(0, len(parts), per_expert)])
        return tensor.to(device=device, dtype=as_dtype)

    _materialize(hf, config, parallel, device, read, tied=LM_HEAD not in files)
    return hf


def random_sharded(config: PretrainedConfig, dtype: torch.dtype, device: torch.device, parallel: TensorParallel,
                   seed: int = 0) -> PreTrainedModel:
    """This rank's shard of a random-weight target (benchmarks): matrices ~ N(0, 1/fan_in), norms 1, biases 0.
    Whole tensors draw the same numbers on every rank; shards draw their own."""
    hf = meta_model(config, dtype)
    shapes = {name: p.shape for name, p in hf.named_parameters(remove_duplicate=False)}
    index = {name: i for i, name in enumerate(shapes)}

    def draw(name: str, shard: Shard | None, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        if name not in shapes:  # a persistent buffer (GLM's routing bias)
            return torch.zeros(hf.get_buffer(name).shape, dtype=as_dtype, device=device)
        shape = list(shapes[name])
        if shard is not None:
            shape[shard.dim] = shard.size(shape[shard.dim])
        generator = torch.Generator(device).manual_seed(seed * 100_003 + index[name] * 17 +
                                                        (parallel.rank if shard is not None else 0))
        if len(shape) == 1:
            return (torch.ones if "norm" in name else torch.zeros)(shape, dtype=dtype, device=device)
        std = 1.0 if "embed" in name else shapes[name][-1] ** -0.5
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator)

    _materialize(hf, config, parallel, device, draw, tied=bool(config.tie_word_embeddings))
    return hf


def meta_model(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    from ..model.attention import ATTN_IMPLEMENTATION
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)


def _materialize(hf: PreTrainedModel, config: PretrainedConfig, parallel: TensorParallel, device: torch.device,
                 read, tied: bool) -> None:
    """Replace every meta parameter by ``read(name, shard)``; lm_head last (a slice of the embedding when tied)."""
    for module_name, module in hf.named_modules():
        for param_name in list(module._parameters):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if name == LM_HEAD or module._parameters[param_name] is None:
                continue
            shard = shard_of(name, config, parallel)
            tensor = read(name, shard)
            if shard is not None and shard.zero:
                tensor = torch.zeros_like(tensor)
            module._parameters[param_name] = nn.Parameter(tensor, requires_grad=False)
        for buffer_name, buffer in list(module._buffers.items()):  # checkpoint buffers (not rotary tables)
            if buffer is not None and buffer.is_meta and buffer_name not in module._non_persistent_buffers_set:
                module._buffers[buffer_name] = read(f"{module_name}.{buffer_name}", None, buffer.dtype)
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape
    head = hf.get_output_embeddings()
    shard = shard_of(LM_HEAD, config, parallel)
    weight = hf.get_input_embeddings().weight[shard.start:shard.stop] if tied else read(LM_HEAD, shard)
    if weight.shape[0] < shard.stop - shard.start:  # the last rank's padding rows: logits cut off after the gather
        weight = torch.cat([weight, weight.new_zeros(shard.stop - shard.start - weight.shape[0], weight.shape[1])])
    head.weight = nn.Parameter(weight, requires_grad=False)
    head.out_features = weight.shape[0]
    rebuild_meta_buffers(hf, config, device)


def shard_in_place(module: nn.Module, config: PretrainedConfig, parallel: TensorParallel) -> None:
    """Cut an already loaded ``module`` (a draft head) down to this rank's shard by the names of its parameters,
    as :func:`shard_of` cuts a target (``config``: its shapes; ``lm_head.weight``: the vocabulary rows, the last
    rank's tail zero padding). Whole parameters stay as they are, shared ones (an embedding) untouched."""
    for module_name, sub in module.named_modules():
        for param_name, param in list(sub._parameters.items()):
            name = f"{module_name}.{param_name}" if module_name else param_name
            shard = None if param is None else shard_of(name, config, parallel)
            if shard is None:
                continue
            before = (slice(None),) * shard.dim
            part = torch.cat([param.data[(*before, slice(a, b))] for a, b in shard.ranges(param.shape[shard.dim])],
                             dim=shard.dim)
            if part.shape[shard.dim] < shard.stop - shard.start and not shard.halves:  # vocabulary padding
                pad = list(part.shape)
                pad[shard.dim] = shard.stop - shard.start - part.shape[shard.dim]
                part = torch.cat([part, part.new_zeros(pad)], dim=shard.dim)
            part = torch.zeros_like(part) if shard.zero else part
            sub._parameters[param_name] = nn.Parameter(part.contiguous(), requires_grad=False)
        if isinstance(sub, nn.Linear):
            sub.out_features, sub.in_features = sub.weight.shape


def rebuild_meta_buffers(hf: PreTrainedModel, config: PretrainedConfig, device: torch.device) -> None:
    """Rotary modules hold computed (non-checkpoint) buffers: build them again on ``device``."""
    for name, module in list(hf.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        if not name.endswith("rotary_emb"):
            raise ValueError(f"tensor parallelism cannot rebuild the buffers of {name} ({type(module).__name__})")
        parent = hf.get_submodule(name.rpartition(".")[0])
        with torch.device(device):
            setattr(parent, name.rpartition(".")[2], type(module)(config=config))


def weight_files(path: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{path}: tensor parallelism and FP8 checkpoints read safetensors files (model.safetensors "
                                "or model.safetensors.index.json); none found")
    with safe_open(str(single), framework="pt", device="cpu") as handle:
        return {name: single.name for name in handle.keys()}
