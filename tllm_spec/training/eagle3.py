"""EAGLE-3 head training with the training-time test (TTT): the head is unrolled over ``ttt_steps`` draft levels,
each fed its own previous pre-norm hidden state, under the attention pattern inference produces
(:mod:`.ttt`). Follows EAGLE-3 / SpecForge (``OnlineEagle3Model``): level j of the chain starting at t reads
the ground-truth token t+j+1 at RoPE position t+j and is trained on the target's distribution of token
t+j+2 (soft labels, renormalised over the draft vocabulary), loss weights 0.8 ** j.

Departures, all about initialisation: the draft ``lm_head`` starts as the target's rows of the draft
vocabulary and the final ``norm`` as the target's final norm (the draft then starts out speaking the target's
output space), and the token embedding is the target's own, frozen and not saved -- as our loader expects.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..drafts.eagle3.checkpoint import Eagle3Checkpoint, Eagle3HeadConfig, load_eagle3_checkpoint
from ..drafts.eagle3.model import Eagle3DraftModel
from .teacher import Teacher, TeacherOutputs, distill_level, level_weights, shift_ids
from .ttt import TTTCache
from .vocab import DraftVocab


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Outputs of layers (1, L//2 - 1, L - 4), 0-based (= ``hidden_states`` entries 2, L//2, L - 3)."""
    return 1, num_layers // 2 - 1, num_layers - 4


def head_config(target: PretrainedConfig, draft_vocab_size: int, aux_layers: tuple[int, ...],
                intermediate_size: int | None = None, num_key_value_heads: int | None = None) -> Eagle3HeadConfig:
    """A one-layer head shaped like the target's layers (same hidden size, heads and RoPE)."""
    heads = target.num_attention_heads
    layer = LlamaConfig(
        hidden_size=target.hidden_size, intermediate_size=intermediate_size or target.intermediate_size,
        num_attention_heads=heads, num_key_value_heads=num_key_value_heads or target.num_key_value_heads or heads,
        head_dim=getattr(target, "head_dim", None) or target.hidden_size // heads,
        rms_norm_eps=target.rms_norm_eps, hidden_act="silu", attention_bias=False,
        max_position_embeddings=target.max_position_embeddings, rope_parameters=dict(target.rope_parameters),
        vocab_size=target.vocab_size, num_hidden_layers=1, tie_word_embeddings=False)
    return Eagle3HeadConfig(layer, draft_vocab_size, target.hidden_size, _stored_aux_ids(aux_layers),
                            norm_before_residual=False, has_embedding=False, dialect="eagle")


def _stored_aux_ids(layers: tuple[int, ...]) -> tuple[int, ...]:
    """The ids written to the head's config so that the loader's convention rule (a list starting at 1 is
    output-of-layer, anything else input-to-layer) reads back exactly ``layers`` (output-of-layer)."""
    layers = tuple(sorted(layers))
    if len(layers) != 3 or layers[0] < 0:
        raise ValueError(f"aux layers {layers}: need 3 non-negative decoder-layer ids (repeats allowed)")
    if layers[0] == 0:
        raise ValueError("aux layer 0 cannot be written unambiguously into an EAGLE-3 config (the id lists (0, ...) "
                         "and (1, ...) read back as other layers); pick layers >= 1")
    return layers if layers[0] == 1 else tuple(i + 1 for i in layers)


def init_head(config: Eagle3HeadConfig, teacher: Teacher, vocab: DraftVocab, seed: int = 0) -> Eagle3DraftModel:
    """A fresh head: default init, lm_head = the target's draft-vocabulary rows, norm = the target's final norm,
    the target's (frozen) embedding."""
    torch.manual_seed(seed)
    draft = Eagle3DraftModel(config, kv_layer=0, target_embedding=nn.Embedding(1, 1))  # placeholder for .to()
    draft.to(device=teacher.lm_head.weight.device, dtype=torch.float32)
    draft.embed_tokens = teacher.decoder.embed_tokens  # the target's, frozen, in its own dtype
    with torch.no_grad():
        draft.lm_head.weight.copy_(teacher.lm_head.weight[vocab.draft_ids.to(draft.lm_head.weight.device)])
        draft.norm.weight.copy_(teacher.decoder.norm.weight)
        draft.d2t.copy_(vocab.d2t)
    return draft


def load_head(path: str | Path, teacher_model: nn.Module) -> tuple[Eagle3Checkpoint, DraftVocab]:
    """An existing head to fine-tune: its checkpoint (read against the target's sizes) and its draft vocabulary."""
    config = teacher_model.config
    ckpt = load_eagle3_checkpoint(path, target_hidden_size=config.hidden_size, target_vocab_size=config.vocab_size)
    d2t = ckpt.state_dict["d2t"]
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t] = True
    return ckpt, DraftVocab(d2t.clone(), t2d)


def widen_mlp(ckpt: Eagle3Checkpoint, intermediate_size: int, seed: int = 0) -> Eagle3Checkpoint:
    """``ckpt`` with its MLP widened to ``intermediate_size`` units without changing what it computes: the new
    gate / up rows are drawn at the scale of the existing ones, the new down-projection columns are zero (the
    new units start silent and are trained from there)."""
    layer = ckpt.config.llama_config
    width = layer.intermediate_size
    if intermediate_size < width:
        raise ValueError(f"intermediate_size {intermediate_size}: the head's MLP has {width} units; it can be "
                         "widened, not narrowed")
    if intermediate_size == width:
        return ckpt
    generator = torch.Generator().manual_seed(seed)
    state, extra = dict(ckpt.state_dict), intermediate_size - width
    for name in ("gate_proj", "up_proj"):
        weight = state[f"midlayer.mlp.{name}.weight"]
        fresh = torch.randn(extra, weight.shape[1], generator=generator) * weight.float().std()
        state[f"midlayer.mlp.{name}.weight"] = torch.cat([weight, fresh.to(weight.dtype)])
    down = state["midlayer.mlp.down_proj.weight"]
    state["midlayer.mlp.down_proj.weight"] = torch.cat([down, down.new_zeros(down.shape[0], extra)], dim=1)
    wider = LlamaConfig.from_dict({**layer.to_dict(), "intermediate_size": intermediate_size})
    return Eagle3Checkpoint(replace(ckpt.config, llama_config=wider), state)


def head_from_checkpoint(ckpt: Eagle3Checkpoint, teacher: Teacher) -> Eagle3DraftModel:
    """An fp32 trainable copy of ``ckpt``'s head on the teacher's device, with the target's (frozen) embedding."""
    draft = Eagle3DraftModel.from_checkpoint(ckpt, 0, nn.Embedding(1, 1), torch.float32, teacher.lm_head.weight.device)
    draft.embed_tokens = teacher.decoder.embed_tokens
    return draft


class Eagle3Trainer(nn.Module):
    """Loss and per-level accuracy of an :class:`Eagle3DraftModel` unrolled over ``ttt_steps`` levels."""

    def __init__(self, draft: Eagle3DraftModel, vocab: DraftVocab, ttt_steps: int, tv_weight: float = 0.0):
        super().__init__()
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
        self.draft, self.ttt_steps, self.tv_weight = draft, ttt_steps, tv_weight  # tv_weight: see distill_level
        reduced = vocab.size < vocab.t2d.numel()
        device = draft.lm_head.weight.device
        self.register_buffer("draft_ids", vocab.draft_ids.to(device) if reduced else None, persistent=False)
        self.register_buffer("t2d", vocab.t2d.to(device) if reduced else None, persistent=False)
        self.vocab = vocab

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.draft.parameters() if p.requires_grad]

    def forward(self, input_ids: torch.Tensor, teacher: TeacherOutputs) -> tuple[torch.Tensor, dict[str, float]]:
        """input_ids [B, S] -> (weighted loss [], {"loss", "acc0", "overlap0", "acc1", ...})."""
        total, metrics = 0.0, {}
        for j, (logits, weight) in enumerate(zip(self.level_logits(input_ids, teacher), level_weights(self.ttt_steps))):
            fit = distill_level(logits, teacher.logits[:, j + 1:], self.draft_ids, self.t2d, self.tv_weight)
            total = total + weight * fit.loss
            metrics[f"acc{j}"], metrics[f"overlap{j}"] = fit.accuracy.item(), fit.overlap.item()
        metrics["loss"] = float(total.detach())
        return total, metrics

    def level_logits(self, input_ids: torch.Tensor, teacher: TeacherOutputs) -> list[torch.Tensor]:
        """Draft logits [B, S - j - 1, Vd] of each level j (row t predicts token t+j+2, whose target logits are
        teacher.logits[:, j + 1:]); levels with no such row are left out."""
        seq_len = input_ids.shape[1]
        levels = []
        for j, hidden in enumerate(self.unroll(teacher.aux, input_ids)):
            n = seq_len - j - 1  # chains t < n have their level-j token t+j+1 and a target label
            if n <= 0:
                break
            levels.append(self.draft.lm_head(self.draft.norm(hidden[:, :n])))
        return levels

    def unroll(self, aux: torch.Tensor, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """aux [B, S, 3H_t] target features, input_ids [B, S] -> pre-norm hidden [B, S, H] of each level
        (row t of level j: chain t's level-j output, which predicts token t+j+2)."""
        cache, outputs = TTTCache(), []
        hidden = self.draft.fc(aux.to(self.draft.fc.weight.dtype))
        for j in range(self.ttt_steps):
            hidden = self._level(hidden, shift_ids(input_ids, j + 1), cache)
            outputs.append(hidden)
        return outputs

    def _level(self, hidden: torch.Tensor, ids: torch.Tensor, cache: TTTCache) -> torch.Tensor:
        """One level of the midlayer (the math of Eagle3Midlayer with TTT attention). hidden [B, S, H], ids
        [B, S] (token t+j+1 in row t) -> pre-norm hidden [B, S, H]."""
        mid = self.draft.midlayer
        positions = torch.arange(ids.shape[1], device=ids.device)[None] + cache.level  # RoPE position t + j
        cos, sin = self.draft.rotary_emb(hidden, positions)
        normed = mid.hidden_norm(hidden)
        residual = normed if mid.norm_before_residual else hidden
        embeds = mid.input_layernorm(self.draft.embed_tokens(ids).to(hidden.dtype))
        h = residual + self._attention(torch.cat([embeds, normed], dim=-1), cos, sin, cache)
        return h + mid.mlp(mid.post_attention_layernorm(h))

    def _attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: TTTCache) -> torch.Tensor:
        """x [B, S, 2H] -> [B, S, H]."""
        attn = self.draft.midlayer.self_attn
        b, s, _ = x.shape
        q = attn.q_proj(x).view(b, s, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, s, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, s, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = cache.attend(q, k, v, attn.head_dim ** -0.5)
        return attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def checkpoint(self, dtype: torch.dtype = torch.float32) -> Eagle3Checkpoint:
        """The head's tensors under canonical keys (embedding excluded), floats cast to ``dtype``, on the CPU."""
        state = {k: v.detach().to("cpu", dtype) for k, v in self.draft.state_dict().items()
                 if not k.startswith(("embed_tokens.", "rotary_emb."))}
        state["d2t"] = self.vocab.d2t.cpu().clone()
        return Eagle3Checkpoint(self.draft.head, state)
