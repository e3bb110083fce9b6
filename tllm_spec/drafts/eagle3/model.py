"""The EAGLE-3 draft head: fc over three target hidden states, one 2H-input decoder layer, its own lm_head."""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from ...distributed.parallel import TensorParallel, check_shardable, gather_vocab
from ...distributed.sharding import shard_in_place
from ...model.attention import AttentionMetadata, attend
from ...model.layers import COMPILE_OPTIONS, MLP, Attention, few_row_kernels, linear, norm
from ...model.quant.linear import Fp8Linear
from ...model.rotary import RotaryTable, apply_rotary
from .checkpoint import Eagle3Checkpoint, Eagle3HeadConfig


class Eagle3Attention(nn.Module):
    """Self-attention whose q/k/v read cat(embedding, hidden) [N, 2H]; K/V in the draft's cache layer."""

    def __init__(self, cfg, kv_layer: int):
        super().__init__()
        self.kv_layer = kv_layer
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata
                ) -> torch.Tensor:
        """x [N, 2H]; rope (cos, sin) [N, 1, D] -> [N, H]."""
        q = apply_rotary(self.q_proj(x).view(-1, self.num_heads, self.head_dim), *rope)
        k = apply_rotary(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim), *rope)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(attend(self.kv_layer, q, k, v, attn, self.head_dim ** -0.5).flatten(1))

    def fused(self) -> Attention:
        """The same attention with one q/k/v GEMM (weights shared as views)."""
        return Attention.from_linears(self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.head_dim,
                                      self.kv_layer, self.head_dim ** -0.5)


class Eagle3Midlayer(nn.Module):
    def __init__(self, cfg, kv_layer: int, norm_before_residual: bool):
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, kv_layer)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def fuse(self) -> None:
        """Inference: swap in fused q/k/v and gate/up projections (the training code keeps the split ones)."""
        if isinstance(self.self_attn, Eagle3Attention):
            self.self_attn = self.self_attn.fused()
            self.mlp = MLP.from_linears(self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionMetadata) -> torch.Tensor:
        """embeds, hidden [N, H]; rope (cos, sin) [N, 1, D] -> pre-norm hidden [N, H]."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # embedding first
        if isinstance(self.mlp, MLP) and few_row_kernels(x, attn):  # fused (inference), few rows
            h = self.self_attn(x, rope, attn, residual=residual, rotary_epilogue=True)
            return self.mlp(norm(h, self.post_attention_layernorm), gated=True, residual=h)
        h = residual + self.self_attn(x, rope, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3DraftModel(nn.Module):
    """Proposes draft tokens from target features. Runs inside the one-model step.

    ``forward`` on the first pass takes the three captured target hidden states [N, 3·H_t] (``fc`` fuses
    them); later passes take its own pre-norm output [N, H]. Token/feature alignment: the feature of
    position t goes with the embedding of token t+1.
    """

    def __init__(self, head: Eagle3HeadConfig, kv_layer: int, target_embedding: nn.Embedding):
        super().__init__()
        cfg = head.llama_config
        self.head = head
        self.kv_layer = kv_layer
        self.fc = nn.Linear(3 * head.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Midlayer(cfg, kv_layer, head.norm_before_residual)
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, head.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(cfg)
        self.rope_table: RotaryTable | None = None  # set by fuse()
        self.parallel: TensorParallel | None = None  # set by shard()
        self._compiled = None  # torch.compile of _forward, for generation-only (graphed) steps
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size) if head.has_embedding
                             else target_embedding)
        self.register_buffer("d2t", torch.zeros(head.draft_vocab_size, dtype=torch.int64), persistent=False)

    @classmethod
    def from_checkpoint(cls, ckpt: Eagle3Checkpoint, kv_layer: int, target_embedding: nn.Embedding,
                        dtype: torch.dtype, device: torch.device) -> Eagle3DraftModel:
        with _no_weight_init():  # every weight comes from the checkpoint: no seconds of random init on the CPU
            model = cls(ckpt.config, kv_layer, target_embedding)
        state = {k: v for k, v in ckpt.state_dict.items() if k != "d2t"}
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith(("embed_tokens.", "rotary_emb."))]
        if missing or unexpected:
            raise ValueError(f"EAGLE-3 head tensors do not fit the model: missing {missing}, unexpected {unexpected}")
        model.d2t.copy_(ckpt.state_dict["d2t"])
        return model.to(device=device, dtype=dtype)

    def _vocab_config(self) -> PretrainedConfig:
        """The head's Llama config with its draft vocabulary as ``vocab_size`` (the lm_head rows it splits)."""
        return self.head.llama_config.__class__.from_dict(
            {**self.head.llama_config.to_dict(), "vocab_size": self.head.draft_vocab_size})

    def shard_refusal(self, parallel: TensorParallel) -> str | None:
        """Why :meth:`shard` cannot split this head over ``parallel`` (an FP8 head, a shape the ranks do not
        divide); None where it can."""
        if any(isinstance(m, Fp8Linear) for m in self.modules()):
            return ("tp_draft='sharded' with an FP8 head (draft_quantization) is not supported; use "
                    "tp_draft='replicated'")
        try:
            check_shardable(self._vocab_config(), parallel.size)
        except ValueError as exc:
            return f"tp_draft='sharded': the EAGLE-3 head cannot be split: {exc}"
        return None

    def shard(self, parallel: TensorParallel) -> None:
        """Keep this tensor-parallel rank's part of the head, split as the target is (``distributed/sharding.py``):
        its attention heads (q/k/v rows, o columns), MLP units (gate/up rows, down columns) and draft-vocabulary
        rows of lm_head; fc, the norms and the embedding stay whole. Before :meth:`fuse`, whose layers then
        all-reduce the o and down partial sums (the residual added once), and :meth:`compute_logits` gathers the
        vocabulary. Every rank computes the same hidden rows, so the drafts are the same on every rank."""
        if self.is_fused:
            raise RuntimeError("shard the EAGLE-3 head before fusing it")
        refusal = self.shard_refusal(parallel)
        if refusal is not None:
            raise ValueError(refusal)
        shard_in_place(self, self._vocab_config(), parallel)
        attn = self.midlayer.self_attn
        attn.num_heads = attn.q_proj.out_features // attn.head_dim
        attn.num_kv_heads = attn.k_proj.out_features // attn.head_dim
        self.parallel = parallel

    @property
    def is_fused(self) -> bool:
        return not isinstance(self.midlayer.self_attn, Eagle3Attention)

    def fuse(self, max_positions: int) -> None:
        """Inference fast path: fused projections and a precomputed RoPE table for positions < max_positions."""
        self.midlayer.fuse()
        if self.parallel is not None:
            self.midlayer.self_attn.tp_group = self.midlayer.mlp.tp_group = self.parallel.group_name
        if self.rope_table is None:
            self.rope_table = RotaryTable.from_hf(self.rotary_emb, max_positions, self.lm_head.weight.dtype)
        elif self.rope_table.max_positions < max_positions:
            self.rope_table.resize(max_positions)

    @property
    def kv_shape(self) -> tuple[int, int]:
        """(KV heads, head_dim) of the head's KV layer (this rank's KV heads once sharded)."""
        cfg = self.head.llama_config
        if self.parallel is None:
            return cfg.num_key_value_heads, cfg.head_dim
        start, stop = self.parallel.kv_heads(cfg.num_key_value_heads)
        return stop - start, cfg.head_dim

    @property
    def vocab_offsets(self) -> torch.Tensor | None:
        return self.d2t if self.head.draft_vocab_size != self.head.llama_config.vocab_size else None

    def compile(self) -> None:
        """torch.compile the passes (dynamic shapes) for steps without prompts; prompts stay eager."""
        self._compiled = self._compiled or torch.compile(self._forward, dynamic=True, options=COMPILE_OPTIONS)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """input_ids [N] (the token after each position), hidden [N, 3H_t] or [N, H] -> pre-norm hidden [N, H]."""
        use_compiled = self._compiled is not None and not attn.context_lens
        return (self._compiled if use_compiled else self._forward)(input_ids, hidden, attn)

    def _forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        if hidden.shape[-1] == self.fc.in_features:  # first pass: fuse the target's features
            hidden = linear(hidden.to(self.lm_head.weight.dtype), self.fc)  # the head's dtype (fc may be FP8)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        return self.midlayer(embeds, hidden, self._rope(hidden, attn.rotary_positions), attn)

    def _rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [N, 1, D] of the draft's own RoPE."""
        if self.rope_table is not None:
            return self.rope_table(positions)
        cos, sin = self.rotary_emb(hidden, positions[None])
        return cos[0][:, None], sin[0][:, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., H] -> draft-vocabulary logits [..., V_draft] fp32 (sharded: gathered from every
        rank, a tree's [B, F, H] frontier as its B x F rows)."""
        logits = linear(self.norm(hidden), self.lm_head).float()
        if self.parallel is not None:
            rows = logits.flatten(0, -2)
            logits = gather_vocab(rows, self.head.draft_vocab_size, self.parallel).view(*logits.shape[:-1], -1)
        return logits


def resolve_capture_layers(override: tuple[int, ...] | None, checkpoint_ids: tuple[int, ...] | None,
                           num_layers: int) -> tuple[int, ...]:
    """Target decoder layers whose outputs feed the head (output-of-layer convention, 0-based), sorted.

    ``override`` (Eagle3Config.eagle3_layers_to_capture) is taken as is. Ids from a head's config come in
    two conventions; as SGLang does, a list starting at 1 is read as output-of-layer, anything else as
    input-to-layer (so each id - 1). Default: (1, L//2 - 1, L - 4), the residual stream entering layers
    2, L//2 and L-3, as TensorRT-LLM, which also refuses that default below 6 layers. Ids may repeat
    (the default on 6 layers is (1, 2, 2)): fc then reads that layer twice. Sorted low -> high, as
    TensorRT-LLM sorts explicit lists, which is the order fc's input columns are concatenated in.
    """
    if override is not None:
        layers = tuple(override)
    elif checkpoint_ids:
        layers = tuple(checkpoint_ids) if checkpoint_ids[0] == 1 else tuple(i - 1 for i in checkpoint_ids)
    elif num_layers < 6:
        raise ValueError(f"a target with {num_layers} decoder layers is too shallow for EAGLE-3's default capture "
                         f"layers (1, L//2-1, L-4); set Eagle3Config.eagle3_layers_to_capture")
    else:
        layers = (1, num_layers // 2 - 1, num_layers - 4)
    if len(layers) != 3 or min(layers) < 0 or max(layers) >= num_layers:
        raise ValueError(f"EAGLE-3 capture layers {layers} are invalid for a target with {num_layers} layers "
                         f"(need 3 ids in [0, {num_layers})); set Eagle3Config.eagle3_layers_to_capture")
    return tuple(sorted(layers))


def _no_weight_init() -> contextlib.AbstractContextManager:
    """transformers' switch that skips torch's weight initialisers (for modules whose weights are loaded next);
    a no-op where this transformers lacks it."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()
