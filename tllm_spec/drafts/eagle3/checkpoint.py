"""EAGLE-3 draft-head checkpoints: read the eagle / angelslim / speculators dialects into canonical keys.

The dialect is decided by tensor names (`midlayer.` vs `layers.0.`); `architectures` only tells AngelSlim
from EAGLE. Unimplemented variants (`norm_before_fc`, `fc_norm`, `norm_output`, more layers) raise
NotImplementedError; malformed checkpoints raise ValueError naming the tensor or field.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

DIALECTS = ("eagle", "angelslim", "speculators")
_ARCHITECTURE = {
    "eagle": "LlamaForCausalLMEagle3", "angelslim": "Eagle3LlamaForCausalLM", "speculators": "Eagle3Speculator"}
_MID = "midlayer."
_LAYER_RE = re.compile(r"^layers\.(\d+)\.")
_TRAINING_ONLY = frozenset({"t2d", "verifier_lm_head.weight", "verifier_norm.weight"})  # teacher copies, vocab mask
# speculators / vLLM variant switches we do not implement: truthy in any config scope => refuse
_UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "mlp_bias", "use_sliding_window")
_PICKLE_HINT = (
    "pickle checkpoints (.bin/.pt) are refused (loading them can run arbitrary code); convert once with:\n"
    "    import torch, safetensors.torch\n"
    "    sd = torch.load('pytorch_model.bin', map_location='cpu', weights_only=True)\n"
    "    safetensors.torch.save_file({k: v.clone().contiguous() for k, v in sd.items()}, 'model.safetensors')"
)


@dataclass(frozen=True)
class Eagle3HeadConfig:
    """Hyper-parameters of one EAGLE-3 head. `llama_config.vocab_size` is the TARGET vocab."""

    llama_config: LlamaConfig  # the draft decoder layer (rope from the DRAFT config)
    draft_vocab_size: int
    target_hidden_size: int  # H_t: fc.weight is [H, 3*H_t]
    aux_layer_ids: tuple[int, ...] | None  # raw ids from the config, convention not resolved here
    norm_before_residual: bool  # residual = hidden_norm(h) instead of h (speculators / vLLM flag)
    has_embedding: bool  # checkpoint carries embed_tokens.weight
    dialect: str


@dataclass(frozen=True)
class Eagle3Checkpoint:
    config: Eagle3HeadConfig
    state_dict: dict[str, torch.Tensor]  # canonical keys; d2t [draft_vocab] int64 always present


def load_eagle3_checkpoint(
    path: str | Path, target_hidden_size: int | None = None, target_vocab_size: int | None = None
) -> Eagle3Checkpoint:
    """Load a head directory (config.json + safetensors) of any dialect into canonical keys.

    `target_hidden_size` / `target_vocab_size`, when given, must match the checkpoint (H_t, vocab).
    """
    root = Path(path)
    raw = _read_config(root)
    _reject_variants(raw)
    state, dialect = _canonical_state(_read_tensors(root), raw)
    config = _head_config(raw, state, dialect, target_hidden_size, target_vocab_size)
    state["d2t"] = _checked_d2t(state.get("d2t"), config)
    _check_shapes(state, config)
    return Eagle3Checkpoint(config, state)


def save_eagle3_checkpoint(path: str | Path, checkpoint: Eagle3Checkpoint, dialect: str) -> None:
    """Write config.json + model.safetensors the way `dialect`'s own tooling would."""
    if dialect not in DIALECTS:
        raise ValueError(f"dialect {dialect!r}: expected one of {DIALECTS}")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(_config_dict(checkpoint.config, dialect), indent=2))
    save_file(_dialect_tensors(checkpoint, dialect), str(root / "model.safetensors"), metadata={"format": "pt"})


def _read_config(root: Path) -> dict[str, Any]:
    file = root / "config.json"
    if not file.is_file():
        raise ValueError(f"{root}: config.json not found (an EAGLE-3 head needs config.json + safetensors)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: invalid JSON ({exc})") from exc


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    single, index = root / "model.safetensors", root / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        files = [root / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    elif any(p.suffix in {".bin", ".pt", ".pth"} for p in root.iterdir()):
        raise ValueError(f"{root}: no model.safetensors; {_PICKLE_HINT}")
    else:
        raise ValueError(f"{root}: neither model.safetensors nor model.safetensors.index.json found")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ValueError(f"{file}: not a readable safetensors file ({exc})") from exc
    return tensors


def _reject_variants(raw: dict[str, Any]) -> None:
    """Refuse configs asking for maths this loader's consumers do not implement."""
    eagle_config = raw.get("eagle_config") or {}
    layer = raw.get("transformer_layer_config") or {}
    for scope, fields in (("", raw), ("eagle_config.", eagle_config), ("transformer_layer_config.", layer)):
        for flag in _UNSUPPORTED_FLAGS:
            if fields.get(flag):
                raise NotImplementedError(f"config field {scope}{flag}={fields[flag]!r}: variant not supported")
    if eagle_config.get("use_aux_hidden_state", True) is False:
        raise NotImplementedError("config field eagle_config.use_aux_hidden_state=false (no fc): not supported")
    if layer and layer.get("model_type", "llama") != "llama":
        raise NotImplementedError(f"transformer_layer_config.model_type={layer['model_type']!r}: only llama layers")
    hparams = layer or raw
    if any(kind != "full_attention" for kind in hparams.get("layer_types") or []):
        raise NotImplementedError(f"config field layer_types={hparams['layer_types']}: only full attention")
    aux = _aux_layer_ids(raw)
    num_aux = (("eagle_aux_hidden_state_layer_ids", len(aux) if aux else 3),
               ("num_aux_hidden_states", raw.get("num_aux_hidden_states", 3)))
    for field, count in num_aux:
        if count != 3:
            raise NotImplementedError(f"config field {field}: {count} captured target layers, only 3 supported")


def _canonical_state(tensors: dict[str, torch.Tensor], raw: dict[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """Rename `layers.0.` to `midlayer.`, drop training-only tensors; returns (state, dialect)."""
    layer_ids = sorted({int(m.group(1)) for key in tensors if (m := _LAYER_RE.match(key))})
    has_mid = any(key.startswith(_MID) for key in tensors)
    if layer_ids and has_mid:
        raise ValueError("checkpoint mixes midlayer.* and layers.N.* tensors: cannot tell the dialect")
    if len(layer_ids) > 1:
        raise NotImplementedError(f"head has {len(layer_ids)} decoder layers (layers.{layer_ids}); only 1 supported")
    if layer_ids != [0] and not has_mid:
        found = f"layers.{layer_ids[0]}.*" if layer_ids else "none"
        if any(key.startswith("model.layers.") for key in tensors):
            found += " (it holds model.layers.*: a whole causal LM, not an EAGLE-3 head)"
        raise ValueError(f"not an EAGLE-3 head: decoder-layer tensors: expected midlayer.* or layers.0.*, found "
                         f"{found}")
    state = {_MID + k[len("layers.0."):] if k.startswith("layers.0.") else k: v
             for k, v in tensors.items() if k not in _TRAINING_ONLY}
    if layer_ids:
        return state, "speculators"
    return state, "angelslim" if "Eagle3LlamaForCausalLM" in (raw.get("architectures") or []) else "eagle"


def _head_config(raw: dict[str, Any], state: dict[str, torch.Tensor], dialect: str,
                 target_hidden_size: int | None, target_vocab_size: int | None) -> Eagle3HeadConfig:
    hparams = raw.get("transformer_layer_config") or raw
    vocab_size = hparams.get("vocab_size", target_vocab_size)
    if vocab_size is None:
        raise ValueError("config field vocab_size (target vocab) missing and no target_vocab_size given")
    if target_vocab_size is not None and vocab_size != target_vocab_size:
        raise ValueError(f"config field vocab_size: checkpoint has {vocab_size}, target vocab is {target_vocab_size}")
    if "fc.weight" not in state:
        raise ValueError("fc.weight: required tensor missing from the checkpoint")
    return Eagle3HeadConfig(
        llama_config=head_llama_config(hparams, vocab_size),
        draft_vocab_size=int(raw.get("draft_vocab_size") or hparams.get("draft_vocab_size") or vocab_size),
        target_hidden_size=_target_hidden_size(raw, tuple(state["fc.weight"].shape), target_hidden_size),
        aux_layer_ids=_aux_layer_ids(raw),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        has_embedding="embed_tokens.weight" in state,
        dialect=dialect,
    )


def head_llama_config(hparams: dict[str, Any], vocab_size: int) -> LlamaConfig:
    """The single draft layer's LlamaConfig; num_hidden_layers is never read (it may be the target's)."""
    for field in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if hparams.get(field) is None:
            raise ValueError(f"config field {field} missing")
    heads = hparams["num_attention_heads"]
    return LlamaConfig(
        hidden_size=hparams["hidden_size"], intermediate_size=hparams["intermediate_size"],
        num_attention_heads=heads, num_key_value_heads=hparams.get("num_key_value_heads") or heads,
        head_dim=hparams.get("head_dim") or hparams["hidden_size"] // heads,
        rms_norm_eps=hparams.get("rms_norm_eps", 1e-6), hidden_act=hparams.get("hidden_act", "silu"),
        attention_bias=bool(hparams.get("attention_bias", False)),
        max_position_embeddings=hparams.get("max_position_embeddings", 2048),
        rope_parameters=_rope_parameters(hparams), vocab_size=vocab_size, num_hidden_layers=1,
        tie_word_embeddings=False,
    )


def _rope_parameters(hparams: dict[str, Any]) -> dict[str, Any]:
    """transformers-5 `rope_parameters` from new-style or old-style (`rope_theta` + `rope_scaling`) fields."""
    params = dict(hparams.get("rope_parameters") or hparams.get("rope_scaling") or {})
    legacy_type = params.pop("type", "default")
    params.setdefault("rope_type", legacy_type)
    params.setdefault("rope_theta", float(hparams.get("rope_theta", 10000.0)))
    return params


def _target_hidden_size(raw: dict[str, Any], fc_shape: tuple[int, ...], given: int | None) -> int:
    declared = raw.get("target_hidden_size")
    if declared is None:
        if len(fc_shape) != 2 or fc_shape[1] % 3:
            raise ValueError(f"fc.weight: expected shape [hidden_size, 3*target_hidden_size], found {list(fc_shape)}")
        declared = fc_shape[1] // 3
    if given is not None and given != declared:
        raise ValueError(f"target_hidden_size: the head expects {declared} (fc.weight {list(fc_shape)}), "
                         f"the target has {given}")
    return int(declared)


def _aux_layer_ids(raw: dict[str, Any]) -> tuple[int, ...] | None:
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = ids if ids is not None else raw.get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else None  # [] means "use the default layers", as in vLLM


def _checked_d2t(d2t: torch.Tensor | None, config: Eagle3HeadConfig) -> torch.Tensor:
    """[draft_vocab] int64 offsets with i + d2t[i] a distinct id in [0, vocab)."""
    draft, vocab = config.draft_vocab_size, config.llama_config.vocab_size
    if d2t is None:
        if draft != vocab:
            raise ValueError(f"d2t: missing, but draft_vocab_size {draft} != vocab_size {vocab}")
        return torch.zeros(draft, dtype=torch.int64)
    if tuple(d2t.shape) != (draft,) or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise ValueError(f"d2t: expected integer shape [{draft}] (draft_vocab_size), "
                         f"found {d2t.dtype} {list(d2t.shape)}")
    target_ids = torch.arange(draft) + d2t.long()
    bad = ((target_ids < 0) | (target_ids >= vocab)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"d2t: draft id {i} maps to target id {int(target_ids[i])}, outside [0, {vocab})")
    if target_ids.unique().numel() != draft:
        raise ValueError("d2t: two draft ids map to the same target id")
    return d2t.long()


def expected_shapes(config: Eagle3HeadConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Canonical key -> (shape, formula) for every tensor except d2t."""
    c = config.llama_config
    h, hq, hkv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    i = c.intermediate_size
    layer = {
        "input_layernorm.weight": ((h,), "[H]"), "hidden_norm.weight": ((h,), "[H]"),
        "self_attn.q_proj.weight": ((hq, 2 * h), "[Hq*D, 2H]"), "self_attn.o_proj.weight": ((h, hq), "[H, Hq*D]"),
        "self_attn.k_proj.weight": ((hkv, 2 * h), "[Hkv*D, 2H]"),
        "self_attn.v_proj.weight": ((hkv, 2 * h), "[Hkv*D, 2H]"),
        "post_attention_layernorm.weight": ((h,), "[H]"), "mlp.down_proj.weight": ((h, i), "[H, I]"),
        "mlp.gate_proj.weight": ((i, h), "[I, H]"), "mlp.up_proj.weight": ((i, h), "[I, H]"),
    }
    shapes = {"fc.weight": ((h, 3 * config.target_hidden_size), "[H, 3*H_t]"), "norm.weight": ((h,), "[H]"),
              "lm_head.weight": ((config.draft_vocab_size, h), "[draft_vocab, H]"),
              **{_MID + name: spec for name, spec in layer.items()}}
    if c.attention_bias:  # HF / vLLM LlamaAttention put a bias on o_proj as well
        for proj, rows in (("q", hq), ("k", hkv), ("v", hkv), ("o", h)):
            shapes[f"midlayer.self_attn.{proj}_proj.bias"] = ((rows,), f"[{rows}]")
    if config.has_embedding:
        shapes["embed_tokens.weight"] = ((c.vocab_size, h), "[vocab, H]")
    return shapes


def _check_shapes(state: dict[str, torch.Tensor], config: Eagle3HeadConfig) -> None:
    expected = expected_shapes(config)
    for name, (shape, formula) in expected.items():
        if name not in state:
            raise ValueError(f"{name}: required tensor missing from the checkpoint")
        if tuple(state[name].shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)} = {formula}, found {list(state[name].shape)}")
    unexpected = sorted(set(state) - set(expected) - {"d2t"})
    if unexpected:
        raise ValueError(f"unexpected tensors {unexpected}: not part of a plain EAGLE-3 head "
                         "(input_norm / fc_norm / mask_hidden belong to unsupported variants)")


def _config_dict(config: Eagle3HeadConfig, dialect: str) -> dict[str, Any]:
    aux = list(config.aux_layer_ids) if config.aux_layer_ids is not None else None
    if dialect == "speculators":
        h = config.llama_config.hidden_size
        return {
            "architectures": [_ARCHITECTURE[dialect]], "speculators_model_type": "eagle3",
            "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": None if config.target_hidden_size == h else config.target_hidden_size,
            "norm_before_residual": config.norm_before_residual, "norm_before_fc": False,
            "eagle_aux_hidden_state_layer_ids": aux,
            "transformer_layer_config": _layer_hparams(config.llama_config, legacy_rope=False),
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy", "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": 3}], "verifier": {"name_or_path": None}},
        }
    out = {"architectures": [_ARCHITECTURE[dialect]], **_layer_hparams(config.llama_config, legacy_rope=True),
           "draft_vocab_size": config.draft_vocab_size, "target_hidden_size": config.target_hidden_size}
    if config.norm_before_residual:
        out["norm_before_residual"] = True
    if aux is not None and dialect == "eagle":
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True}
    elif aux is not None:
        out["eagle_aux_hidden_state_layer_ids"] = aux
    return out


def _layer_hparams(c: LlamaConfig, legacy_rope: bool) -> dict[str, Any]:
    out = {
        "model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "hidden_act": c.hidden_act,
        "attention_bias": c.attention_bias, "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size, "num_hidden_layers": 1, "tie_word_embeddings": False,
    }
    rope = dict(c.rope_parameters)
    if not legacy_rope:
        return {**out, "rope_parameters": rope}
    theta = rope.pop("rope_theta")
    return {**out, "rope_theta": theta, "rope_scaling": None if rope["rope_type"] == "default" else rope}


def _dialect_tensors(checkpoint: Eagle3Checkpoint, dialect: str) -> dict[str, torch.Tensor]:
    """Canonical -> on-disk names; d2t dropped when it is the identity, t2d [vocab] bool added otherwise."""
    prefix = "layers.0." if dialect == "speculators" else _MID
    out = {(prefix + k[len(_MID):] if k.startswith(_MID) else k): v.contiguous()
           for k, v in checkpoint.state_dict.items()}
    config = checkpoint.config
    d2t = out["d2t"]
    if config.draft_vocab_size == config.llama_config.vocab_size and not d2t.any():
        del out["d2t"]
        return out
    t2d = torch.zeros(config.llama_config.vocab_size, dtype=torch.bool)
    t2d[torch.arange(config.draft_vocab_size) + d2t] = True
    out["t2d"] = t2d
    return out
