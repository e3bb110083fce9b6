"""MTP module weights: read the public layouts into canonical per-module state dicts, and write them.

Layouts (decided by tensor names, never by ``architectures``; see shared/formats.md "MTP modules"):

* ``deepseek`` (DeepSeek-V3/R1, GLM-4.5, Step-3.5): ``model.layers.{L+i}.{enorm,hnorm,eh_proj,shared_head.norm}``
  plus a whole decoder block under the same prefix, and optionally the module's own output head
  ``shared_head.head`` (canonical key ``shared_head.head.weight`` [V, H]); ``embed_tokens`` copies are ignored.
* ``mimo`` (Xiaomi MiMo): ``model.mtp_layers.{i}.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}``
  plus the block; ``input_proj`` reads ``cat(hidden, embedding)`` (reversed).
* ``qwen3_next`` (Qwen3-Next / Qwen3.5): ``mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}`` shared by
  all modules, blocks under ``mtp.layers.{i}.``; every RMSNorm weight is stored as ``w - 1`` (``x̂·(1+w)``).

Canonical form (what :class:`MTPCheckpoint` holds): per module ``enorm.weight``, ``hnorm.weight``,
``eh_proj.weight`` [H, 2H] reading ``cat(embedding, hidden)``, ``shared_head.norm.weight`` and the block's own
keys (``self_attn.q_proj.weight``, ``mlp.up_proj.weight``, ...), every norm as a plain ``x̂·w`` weight, plus
``shared_head.head.weight`` where the checkpoint has one.

MoE blocks (GLM-4.5, and any block whose experts transformers holds fused): real checkpoints store each expert
as ``mlp.experts.{e}.{gate,up,down}_proj.weight``; the canonical keys are the block's fused tensors
``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first, then up) and ``mlp.experts.down_proj`` [E, H, I]
(read as is where a checkpoint already stores them fused), next to ``mlp.gate.weight`` (the router, [E, H]),
``mlp.gate.e_score_correction_bias`` [E] (a buffer of the block) and ``mlp.shared_experts.*``. Writing splits
the experts again. MLA attention (DeepSeek-V3/R1) is refused.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

LAYOUTS = ("deepseek", "mimo", "qwen3_next")
OWN_KEYS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
_MIMO_NAMES = {"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight",
               "eh_proj.weight": "input_proj.weight", "shared_head.norm.weight": "final_layernorm.weight"}
_QWEN3_NEXT_NAMES = {"enorm.weight": "mtp.pre_fc_norm_embedding.weight",
                     "hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "eh_proj.weight": "mtp.fc.weight",
                     "shared_head.norm.weight": "mtp.norm.weight"}
_MIMO_KEYS = {v: k for k, v in _MIMO_NAMES.items()}
_QWEN3_NEXT_KEYS = {v: k for k, v in _QWEN3_NEXT_NAMES.items()}
_COUNT_FIELD = {"deepseek": "num_nextn_predict_layers", "mimo": "num_nextn_predict_layers",
                "qwen3_next": "mtp_num_hidden_layers"}
HEAD_KEY = "shared_head.head.weight"  # a module's own output head (DeepSeek layout; often a copy of lm_head)
_IGNORED = ("embed_tokens.weight",)  # copies of the target's embedding
_MLA = ("q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj")
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")  # one expert's matrix
_FUSED_EXPERTS_RE = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")  # all experts' [E, *, *]
_DEEPSEEK_RE = re.compile(r"^model\.layers\.(\d+)\.")
_MIMO_RE = re.compile(r"^model\.mtp_layers\.(\d+)\.")
_QWEN3_NEXT_RE = re.compile(r"^mtp\.layers\.(\d+)\.")


@dataclass(frozen=True)
class MTPCheckpoint:
    """Canonical weights of the first ``len(modules)`` MTP modules of a checkpoint."""

    layout: str
    num_target_layers: int  # L: the DeepSeek layout numbers module i as layer L + i
    modules: list[dict[str, torch.Tensor]]  # canonical keys, see the module docstring

    def disk_name(self, module: int, key: str) -> str:
        """The on-disk name of canonical ``key`` of ``module`` (for error messages)."""
        return disk_name(self.layout, module, key, self.num_target_layers)


def disk_name(layout: str, module: int, key: str, num_target_layers: int) -> str:
    """On-disk name of canonical ``key`` of ``module`` in ``layout``."""
    if layout == "deepseek":
        return f"model.layers.{num_target_layers + module}.{key}"
    if layout == "mimo":
        return f"model.mtp_layers.{module}.{_MIMO_NAMES.get(key, key)}"
    if layout == "qwen3_next":  # unknown shared tensors keep their full name as key
        return _QWEN3_NEXT_NAMES.get(key) or (key if key.startswith("mtp.") else f"mtp.layers.{module}.{key}")
    raise ValueError(f"MTP layout {layout!r}: expected one of {LAYOUTS}")


def load_mtp_checkpoint(path: str | Path, num_target_layers: int, num_modules: int) -> MTPCheckpoint:
    """Read the first ``num_modules`` MTP modules from a checkpoint directory (the target's, or a separate one).

    Only the MTP tensors are read (sharded ``model.safetensors.index.json`` supported). Raises ValueError naming
    the tensor for malformed checkpoints, NotImplementedError for MLA blocks.
    """
    root = Path(path)
    files = _tensor_files(root)
    layout, module_ids = _detect_layout(root, files, num_target_layers)
    if len(module_ids) < num_modules:
        raise ValueError(f"{root}: the checkpoint has {len(module_ids)} MTP module(s) ({layout} layout), "
                         f"num_nextn_predict_layers asks for {num_modules}")
    wanted = {}  # on-disk name -> (module, or None when all modules share it; canonical key)
    for name in files:
        owner = _owner(layout, name, num_target_layers)
        if owner is not False and (owner is None or owner < num_modules):
            key = _canonical_key(layout, name, num_target_layers)
            if key not in _IGNORED:
                wanted[name] = (owner, key)
    _refuse_mla(wanted)
    tensors = _read(files, list(wanted))
    fp8 = [name for name, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    if fp8:  # their scales would be dropped: a wrong draft, never loaded as one
        raise NotImplementedError(f"{fp8[0]}: MTP modules stored in FP8 are not supported yet ({len(fp8)} FP8 "
                                  f"tensors in {root}); give a 16-bit mtp_checkpoint")
    modules: list[dict[str, torch.Tensor]] = [{} for _ in range(num_modules)]
    for name, (owner, key) in wanted.items():
        for i in range(num_modules) if owner is None else (owner,):
            modules[i][key] = _to_canonical(layout, key, tensors[name])
    modules = [_fused_experts(state, lambda key, i=i: disk_name(layout, i, key, num_target_layers))
               for i, state in enumerate(modules)]
    return MTPCheckpoint(layout, num_target_layers, modules)


def save_mtp_weights(target_dir: str | Path, modules: list[dict[str, torch.Tensor]], layout: str,
                     num_target_layers: int | None = None) -> None:
    """Append canonical MTP modules to a checkpoint directory the way real checkpoints carry them: one extra
    safetensors shard, the shard index (created if the directory had a single ``model.safetensors``) and the
    layout's module count in config.json (when there is one); MoE experts one tensor per expert and projection.
    ``num_target_layers`` defaults to config.json."""
    root = Path(target_dir)
    root.mkdir(parents=True, exist_ok=True)
    config_file = root / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else None
    num_layers = num_target_layers if num_target_layers is not None else (config or {}).get("num_hidden_layers")
    if num_layers is None:
        raise ValueError(f"{root}: num_target_layers not given and no config.json with num_hidden_layers")
    tensors: dict[str, torch.Tensor] = {}
    for i, state in enumerate(modules):
        for key, value in _per_expert(state).items():
            name, value = disk_name(layout, i, key, num_layers), _to_disk(layout, key, value).contiguous().clone()
            if name in tensors and not torch.equal(tensors[name], value):
                raise ValueError(f"{name}: shared by every module in the {layout} layout, but module {i} differs")
            tensors[name] = value
    _append_shard(root, tensors)
    if config is not None:
        config[_COUNT_FIELD[layout]] = len(modules)
        config_file.write_text(json.dumps(config, indent=2))


def _tensor_files(root: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it."""
    index, single = root / "model.safetensors.index.json", root / "model.safetensors"
    if index.is_file():
        return {k: root / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt") as f:
                return {k: single for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{single}: not a readable safetensors file ({exc})") from exc
    raise ValueError(f"{root}: neither model.safetensors nor model.safetensors.index.json found (MTP weights are "
                     "read from safetensors only)")


def _detect_layout(root: Path, files: dict[str, Path], num_layers: int) -> tuple[str, list[int]]:
    """(layout, module ids) from tensor names."""
    found = {}
    for name in files:  # MTP-only tensors numbered inside the target's layers: the layer count disagrees
        m = _DEEPSEEK_RE.match(name)
        if m and int(m.group(1)) < num_layers and name.endswith(tuple(f".{k}" for k in OWN_KEYS)):
            raise ValueError(f"{name}: an MTP tensor inside the target's {num_layers} decoder layers (the DeepSeek "
                             f"layout numbers MTP modules model.layers.{num_layers}+i)")
    layers = {int(m.group(1)) for k in files if (m := _DEEPSEEK_RE.match(k))}
    ids = sorted(i - num_layers for i in layers if i >= num_layers)
    if ids:
        found["deepseek"] = ids
    for layout, pattern in (("mimo", _MIMO_RE), ("qwen3_next", _QWEN3_NEXT_RE)):
        ids = sorted({int(m.group(1)) for k in files if (m := pattern.match(k))})
        if ids or (layout == "qwen3_next" and any(k.startswith("mtp.") for k in files)):
            found[layout] = ids or [0]
    if len(found) != 1:
        what = f"tensors of several layouts {sorted(found)}" if found else "no MTP tensors"
        raise ValueError(f"{root}: {what}; expected model.layers.{num_layers}.eh_proj.weight (DeepSeek/GLM), "
                         "model.mtp_layers.0.* (MiMo) or mtp.fc.weight (Qwen3-Next)")
    (layout, ids), = found.items()
    if ids != list(range(len(ids))):
        raise ValueError(f"{root}: MTP modules {ids} ({layout} layout) are not numbered 0..{len(ids) - 1}")
    return layout, ids


def _owner(layout: str, name: str, num_layers: int) -> int | None | bool:
    """Module index of a tensor; None for tensors every module shares; False for non-MTP tensors."""
    if layout == "qwen3_next":
        m = _QWEN3_NEXT_RE.match(name)
        return int(m.group(1)) if m else (None if name.startswith("mtp.") else False)
    m = (_DEEPSEEK_RE if layout == "deepseek" else _MIMO_RE).match(name)
    if not m:
        return False
    index = int(m.group(1)) - (num_layers if layout == "deepseek" else 0)
    return index if index >= 0 else False


def _read(files: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for file, keys in by_file.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in keys})
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{file}: cannot read MTP tensors {keys[:3]}... ({exc})") from exc
    return out


def _refuse_mla(names) -> None:
    for name in names:
        if any(marker in name for marker in _MLA):
            raise NotImplementedError(f"{name}: MLA attention MTP blocks (DeepSeek-V3/R1) are not supported yet "
                                      "(a later issue)")


def _fused_experts(state: dict[str, torch.Tensor], name_of) -> dict[str, torch.Tensor]:
    """``state`` with each block's per-expert ``{p}.{e}.{gate,up,down}_proj.weight`` ([I, H], [I, H], [H, I]) as
    ``{p}.gate_up_proj`` [E, 2I, H] (gate rows first) and ``{p}.down_proj`` [E, H, I]. E is the router's row count
    (the sibling ``gate.weight`` [E, H]), else the highest expert id + 1; a missing expert tensor is refused naming
    it (``name_of(key)``: its on-disk name)."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for key, value in state.items():
        if m := _EXPERT_RE.match(key):
            groups.setdefault(m.group(1), {})[int(m.group(2)), m.group(3)] = value
        else:
            out[key] = value
    for prefix, experts in groups.items():
        router = state.get(prefix.removesuffix("experts") + "gate.weight")
        num_experts = router.shape[0] if router is not None else 1 + max(e for e, _ in experts)
        _check_experts(prefix, experts, num_experts, out, name_of)
        gate, up, down = (torch.stack([experts[e, proj] for e in range(num_experts)]) for proj in _EXPERT_PROJS)
        out[f"{prefix}.gate_up_proj"], out[f"{prefix}.down_proj"] = torch.cat([gate, up], dim=1), down
    return out


def _check_experts(prefix: str, experts: dict[tuple[int, str], torch.Tensor], num_experts: int,
                   fused: dict[str, torch.Tensor], name_of) -> None:
    """Refuse an incomplete or surplus set of per-expert tensors, or one stored both per expert and fused."""
    for e in range(num_experts):
        for proj in _EXPERT_PROJS:
            if (e, proj) not in experts:
                raise ValueError(f"{name_of(f'{prefix}.{e}.{proj}.weight')}: required MTP expert tensor missing "
                                 f"from the checkpoint ({num_experts} experts)")
    surplus = sorted(k for k in experts if k[0] >= num_experts)
    if surplus:
        e, proj = surplus[0]
        raise ValueError(f"{name_of(f'{prefix}.{e}.{proj}.weight')}: expert {e} beyond the router's "
                         f"{num_experts} experts")
    both = [k for k in (f"{prefix}.gate_up_proj", f"{prefix}.down_proj") if k in fused]
    if both:
        raise ValueError(f"{name_of(both[0])}: the experts are stored both fused and one tensor per expert")


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`_fused_experts`: fused expert tensors as one [I, H] / [H, I] tensor per expert."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        m = _FUSED_EXPERTS_RE.match(key)
        if m is None or value.dim() != 3:
            out[key] = value
            continue
        prefix = m.group(1)
        if m.group(2) == "down_proj":
            out.update({f"{prefix}.{e}.down_proj.weight": w for e, w in enumerate(value)})
            continue
        gate, up = value.chunk(2, dim=1)
        for e in range(value.shape[0]):
            out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate[e], up[e]
    return out


def _canonical_key(layout: str, name: str, num_layers: int) -> str:
    """Canonical key of an MTP tensor's on-disk ``name`` (see :func:`_owner` for its module)."""
    if layout == "qwen3_next":
        return _QWEN3_NEXT_KEYS.get(name) or (_QWEN3_NEXT_RE.sub("", name) if _QWEN3_NEXT_RE.match(name) else name)
    key = (_DEEPSEEK_RE if layout == "deepseek" else _MIMO_RE).sub("", name)
    return _MIMO_KEYS.get(key, key) if layout == "mimo" else key


def _to_canonical(layout: str, key: str, value: torch.Tensor) -> torch.Tensor:
    if layout == "mimo" and key == "eh_proj.weight" and value.dim() == 2:
        return torch.cat(value.chunk(2, dim=1)[::-1], dim=1)  # [hidden | embedding] -> [embedding | hidden]
    if layout == "qwen3_next" and key.endswith("norm.weight"):
        return value + 1  # x̂·(1+w) -> x̂·w
    return value


def _to_disk(layout: str, key: str, value: torch.Tensor) -> torch.Tensor:
    if layout == "mimo" and key == "eh_proj.weight":
        return torch.cat(value.chunk(2, dim=1)[::-1], dim=1)
    if layout == "qwen3_next" and key.endswith("norm.weight"):
        return value - 1
    return value


def _append_shard(root: Path, tensors: dict[str, torch.Tensor]) -> None:
    index_file, single = root / "model.safetensors.index.json", root / "model.safetensors"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        shard = f"model-mtp-{len(set(index['weight_map'].values())) + 1:05d}.safetensors"
    elif single.is_file():
        with safe_open(str(single), framework="pt") as f:
            names = list(f.keys())
        total = single.stat().st_size  # header included: total_size is informational only
        single.rename(root / "model-00001-of-00002.safetensors")
        index = {"metadata": {"total_size": total},
                 "weight_map": dict.fromkeys(names, "model-00001-of-00002.safetensors")}
        shard = "model-00002-of-00002.safetensors"
    else:
        index, shard = {"metadata": {}, "weight_map": {}}, "model-mtp.safetensors"
    save_file(tensors, str(root / shard), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(tensors, shard))
    index["metadata"]["total_size"] = index["metadata"].get("total_size", 0) + sum(
        t.numel() * t.element_size() for t in tensors.values())
    index_file.write_text(json.dumps(index, indent=2))
