"""Random-weight targets and draft heads of a given shape, saved in real checkpoint formats.

Used by the tests (tiny models through the real loaders), the benchmark (Llama-3.1-8B-, Qwen3-30B-A3B-,
GLM-4.5-Air- and Mixtral-8x7B-shaped models without a download) and the demo recipe.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from ..drafts.eagle3.checkpoint import (
    Eagle3Checkpoint,
    Eagle3HeadConfig,
    expected_shapes,
    head_llama_config,
    save_eagle3_checkpoint,
)
from ..drafts.mtp.checkpoint import save_mtp_weights
from ..drafts.mtp.model import random_mtp_modules

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512}
TINY_MOE = {**TINY, "head_dim": 16, "vocab_size": 256, "num_experts_per_tok": 2}
DRAFT_VOCAB_SIZE = 32000  # EAGLE-3 heads for Llama-3.1-8B / Qwen3-8B (e.g. EAGLE3-LLaMA3.1-Instruct-8B)
# Config fields of each named shape (for a real model's name, its published config.json's); its model type is in
# MODEL_TYPES (none there: llama). Build one with shape_config: the fields alone name no architecture.
SHAPES = {
    "tiny": TINY,
    "demo": {"hidden_size": 192, "intermediate_size": 640, "num_hidden_layers": 16, "num_attention_heads": 3,
             "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 2048,
             "vocab_size": 4096},  # demo://target
    "small": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 4, "max_position_embeddings": 4096, "vocab_size": 32000},
    "llama-3.1-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                     "vocab_size": 128256, "rope_theta": 500000.0},
    "llama-3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                     "vocab_size": 128256, "rope_theta": 500000.0, "tie_word_embeddings": True},
    "llama-3.1-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                      "vocab_size": 128256, "rope_theta": 500000.0},
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "vocab_size": 151936,
                 "rope_theta": 1000000.0},
    # mixture of experts; intermediate_size is the dense MLP's (Qwen3-MoE: no layer uses it; GLM-4.5: its first
    # layer's; Mixtral: its experts'), the one an EAGLE-3 head for the target takes
    "qwen3-30b-a3b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                      "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
                      "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    "glm-4.5-air": {"hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
                    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5,
                    "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 1408, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                    "routed_scaling_factor": 1.0, "norm_topk_prob": True, "use_qk_norm": False,
                    "attention_bias": True, "num_nextn_predict_layers": 1, "max_position_embeddings": 131072,
                    "vocab_size": 151552, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5},
    "mixtral-8x7b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "max_position_embeddings": 32768, "vocab_size": 32000,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-5},
    # tiny MoE targets of each family (tests, CPU runs): 8 experts (Mixtral 4) of intermediate 32, two per token
    "tiny-qwen3-moe": {**TINY_MOE, "num_experts": 8, "moe_intermediate_size": 32, "norm_topk_prob": True},
    "tiny-glm4-moe": {**TINY_MOE, "n_routed_experts": 8, "n_shared_experts": 1, "moe_intermediate_size": 32,
                      "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                      "partial_rotary_factor": 0.5, "attention_bias": True, "num_nextn_predict_layers": 1},
    "tiny-mixtral": {**TINY_MOE, "num_local_experts": 4, "intermediate_size": 32},
}
MODEL_TYPES = {"qwen3-8b": "qwen3", "qwen3-30b-a3b": "qwen3_moe", "glm-4.5-air": "glm4_moe", "mixtral-8x7b": "mixtral",
               "tiny-qwen3-moe": "qwen3_moe", "tiny-glm4-moe": "glm4_moe", "tiny-mixtral": "mixtral"}


MOE_MODEL_TYPES = ("qwen3_moe", "glm4_moe", "mixtral")


def shape_config(shape: str, **overrides) -> PretrainedConfig:
    """The HF config of a named shape (``SHAPES``, of ``MODEL_TYPES``' model type) with ``overrides``."""
    return AutoConfig.for_model(MODEL_TYPES.get(shape, "llama"), **{**SHAPES[shape], **overrides})


def is_moe_shape(shape: str) -> bool:
    """Whether a named shape is a mixture of experts."""
    return MODEL_TYPES.get(shape) in MOE_MODEL_TYPES


def target_config(model_type: str = "llama", vocab_size: int = 97, **overrides) -> PretrainedConfig:
    """An HF config of ``model_type`` (llama, qwen2, qwen3, mistral) with TINY defaults and overrides."""
    fields = {**TINY, "vocab_size": vocab_size, "tie_word_embeddings": False, "bos_token_id": None,
              "eos_token_id": None, "pad_token_id": None, **overrides}
    return AutoConfig.for_model(model_type, **fields)


def save_random_target(path: str | Path, config: PretrainedConfig, seed: int = 0,
                       dtype: torch.dtype = torch.float32, device: str = "cpu") -> Path:
    """Random weights (fan-in scaled matrices, unit-variance embeddings) saved with save_pretrained."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5 if "embed" not in name else 1.0)
    model.save_pretrained(path)
    return Path(path)


def random_head_for(config: PretrainedConfig, draft_vocab_size: int | None = None, seed: int = 0,
                    aux_layer_ids: tuple[int, ...] | None = None, device: str = "cpu",
                    dtype: torch.dtype = torch.float32) -> Eagle3Checkpoint:
    """A random EAGLE-3 head shaped for ``config``'s target (same hidden size and attention shape), drawn on
    ``device``, held in ``dtype``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return random_eagle3_checkpoint(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=head_dim,
        intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        draft_vocab_size=draft_vocab_size or config.vocab_size, seed=seed, aux_layer_ids=aux_layer_ids,
        device=device, dtype=dtype)


def save_random_head(path: str | Path, config: PretrainedConfig, dialect: str = "eagle", **kwargs) -> Path:
    save_eagle3_checkpoint(path, random_head_for(config, **kwargs), dialect)
    return Path(path)


def save_random_mtp(path: str | Path, config: PretrainedConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> Path:
    """One random MTP module for ``config``'s target (any shape: the block is of the target's own layer class),
    drawn on ``device`` in ``dtype`` (the same weights on every rank of a tensor-parallel group) and written to
    ``path`` (replaced) with the target's config.json, in the DeepSeek layout: an ``MTPConfig.mtp_checkpoint``."""
    path = Path(path)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    config.to_json_file(path / "config.json", use_diff=False)
    states = [{key: value.cpu() for key, value in state.items()}  # off the GPU before the per-expert copies
              for state in random_mtp_modules(config, 1, seed, dtype=dtype, device=device)]
    save_mtp_weights(path, states, "deepseek", num_target_layers=config.num_hidden_layers)
    return path


def random_spec_model(shape: str, spec: str, max_draft_len: int, workdir: str | Path, dtype: torch.dtype,
                      device: str, seed: int = 0, spec_fields: dict | None = None, marks: dict | None = None,
                      draft_shape: str = "llama-3.2-1b", quantization: str | None = None, **engine_kwargs):
    """A SpecModel over a random target of a named shape (``SHAPES``) built on ``device``; ``spec`` is
    "eagle3" (a random head written to ``workdir`` and loaded through the real loader), "draft_target" (a random
    draft LM of ``draft_shape`` with the target's vocabulary, likewise), "mtp" (one random MTP module, likewise,
    MTP-Eagle with ``max_draft_len`` drafts; a directory per rank), "sa" or "none". With
    ``tensor_parallel_size=N`` in ``engine_kwargs`` (under torchrun) each rank draws only its shards.
    ``spec_fields``: more fields of the spec config (a draft tree, use_sa_spec). ``marks``: gets the wall time
    (time.time()) at which the target and the draft checkpoint were ready (start-up's build phases).
    ``quantization``: the target quantized online (``TargetModel.quantize``; the draft keeps ``dtype``)."""
    from ..config import DraftTargetConfig, Eagle3Config, MTPConfig, SAConfig
    from ..distributed.parallel import TensorParallel, local_process_device
    from ..model.target import TargetModel
    from ..sampling import flashinfer_ops
    from ..spec_model import SpecModel

    config = shape_config(shape)
    tp_size = engine_kwargs.get("tensor_parallel_size", 1)
    parallel = TensorParallel.setup(tp_size, torch.device(device)) if tp_size > 1 else None
    device = local_process_device(torch.device(device)) if parallel else device
    flashinfer_ops.start_sampling_build(torch.device(device))  # as SpecModel.from_pretrained does before loading
    target = TargetModel.from_config(config, dtype, device, seed, parallel)
    if quantization:
        target.quantize(quantization)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    marks = {} if marks is None else marks
    marks["target"] = time.time()
    spec_config = None
    if spec == "eagle3":  # the released heads of 8B-class targets draft over 32000 tokens (a d2t-mapped subset)
        head = save_random_head(Path(workdir) / f"{shape}-eagle3", config, seed=seed + 1,
                                draft_vocab_size=min(config.vocab_size, DRAFT_VOCAB_SIZE), device=str(device),
                                dtype=dtype)
        spec_config = Eagle3Config(speculative_model=str(head), max_draft_len=max_draft_len, **(spec_fields or {}))
        marks["draft_checkpoint"] = time.time()
    elif spec == "draft_target":
        draft_config = shape_config(draft_shape, vocab_size=config.vocab_size)
        draft = save_random_target(Path(workdir) / f"{draft_shape}-draft", draft_config, seed + 1, dtype, str(device))
        spec_config = DraftTargetConfig(speculative_model=str(draft), max_draft_len=max_draft_len,
                                        **(spec_fields or {}))
        marks["draft_checkpoint"] = time.time()
    elif spec == "mtp":  # each rank writes its own copy: save_mtp_weights appends to a directory's index
        rank = f"-rank{parallel.rank}" if parallel else ""
        mtp = save_random_mtp(Path(workdir) / f"{shape}-mtp{rank}", config, seed + 1, dtype, device)
        spec_config = MTPConfig(num_nextn_predict_layers=1, max_draft_len=max_draft_len, mtp_checkpoint=str(mtp),
                                **(spec_fields or {}))
        marks["draft_checkpoint"] = time.time()
    elif spec == "sa":
        spec_config = SAConfig(max_draft_len=max_draft_len, **(spec_fields or {}))
    elif spec != "none":
        raise ValueError(f"spec must be 'eagle3', 'draft_target', 'mtp', 'sa' or 'none', got {spec!r}")
    return SpecModel.from_target(target, spec_config, **engine_kwargs)


def random_eagle3_checkpoint(
    hidden_size: int, num_attention_heads: int, num_key_value_heads: int, head_dim: int,
    intermediate_size: int, vocab_size: int, draft_vocab_size: int, target_hidden_size: int | None = None,
    rope_theta: float = 10000.0, seed: int = 0, aux_layer_ids: tuple[int, ...] | list[int] | None = None,
    device: str = "cpu", dtype: torch.dtype = torch.float32,
) -> Eagle3Checkpoint:
    """A random head: weights ~ N(0, 0.02), norms 1 + N(0, 0.02), d2t onto a sorted random subset; drawn on
    ``device`` (a GPU draws an 8B target's head in milliseconds, the CPU in seconds), held on the CPU in
    ``dtype``."""
    hparams = {"hidden_size": hidden_size, "num_attention_heads": num_attention_heads,
               "num_key_value_heads": num_key_value_heads, "head_dim": head_dim,
               "intermediate_size": intermediate_size, "rope_theta": rope_theta, "rms_norm_eps": 1e-5,
               "max_position_embeddings": 4096}
    config = Eagle3HeadConfig(
        head_llama_config(hparams, vocab_size), draft_vocab_size, target_hidden_size or hidden_size,
        tuple(aux_layer_ids) if aux_layer_ids is not None else None, False, False, "eagle",
    )
    g = torch.Generator(device).manual_seed(seed)
    state = {name: _random_tensor(name, shape, g).to("cpu", dtype)
             for name, (shape, _) in expected_shapes(config).items()}
    target_ids = torch.randperm(vocab_size, generator=g, device=device)[:draft_vocab_size].sort().values.cpu()
    state["d2t"] = target_ids - torch.arange(draft_vocab_size)  # [draft_vocab] int64 offsets
    return Eagle3Checkpoint(config, state)


def _random_tensor(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    noise = 0.02 * torch.randn(shape, generator=g, device=g.device)
    return 1.0 + noise if name.endswith("norm.weight") else noise
