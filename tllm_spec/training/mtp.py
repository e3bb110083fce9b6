"""MTP module training (DeepSeek-V3 math): ``x = eh_proj(cat(enorm(emb(t+1)), hnorm(h_t)))`` -> a decoder block of
the target's own class -> ``shared_head.norm`` -> the target's lm_head (shared, frozen); h_t = the target's
final-normed hidden. Labels: the target's distribution of token t+2 (soft labels).

Two layouts of the unroll, matching the two workers:

* one module, ``ttt_steps`` levels (MTP-Eagle): level j of the chain at t reads token t+j+1 and the module's own
  previous output (``hidden_feedback``: pre- or post-``shared_head.norm``) at RoPE position t+j, under the
  training-time-test attention of :mod:`.ttt` -- what :class:`MTPEagleWorker` runs.
* N modules (vanilla MTP): module k reads token t+k+1 and module k-1's output at position t, each with plain
  causal attention over its own keys -- what :class:`MTPWorker` runs.

The block starts as a copy of the target's last decoder layer and ``shared_head.norm`` as its final norm.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..drafts.mtp.model import MTPModule, check_dense_block, check_dense_target
from .teacher import Teacher, TeacherOutputs, distill_level, level_weights, shift_ids
from .ttt import TTT_ATTN_IMPLEMENTATION, TTTCache


def init_mtp_modules(teacher: Teacher, num_modules: int, seed: int = 0) -> list[MTPModule]:
    """Fresh fp32 modules on the teacher's device, numbered as DeepSeek does (module i = layer L + i)."""
    config = copy.deepcopy(teacher.config)
    config._attn_implementation = TTT_ATTN_IMPLEMENTATION
    layer_cls, norm_cls = type(teacher.decoder.layers[0]), type(teacher.decoder.norm)
    check_dense_target(config, norm_cls)
    torch.manual_seed(seed)
    modules = []
    for i in range(num_modules):
        module = MTPModule(config, layer_cls, norm_cls, kv_layer=config.num_hidden_layers + i)
        check_dense_block(module)
        module.to(device=teacher.lm_head.weight.device, dtype=torch.float32)
        module.block.load_state_dict(teacher.decoder.layers[-1].state_dict())
        with torch.no_grad():
            module.shared_head["norm"].weight.copy_(teacher.decoder.norm.weight)
        modules.append(module)
    return modules


class MTPTrainer(nn.Module):
    """Loss and per-level accuracy of MTP module(s); the target's embedding, rotary and lm_head stay outside
    this module's parameters."""

    def __init__(self, modules: list[MTPModule], teacher: Teacher, ttt_steps: int,
                 hidden_feedback: str = "post_norm", tv_weight: float = 0.0):
        super().__init__()
        if hidden_feedback not in ("pre_norm", "post_norm"):
            raise ValueError(f"hidden_feedback must be 'pre_norm' or 'post_norm', got {hidden_feedback!r}")
        if len(modules) > 1 and ttt_steps != len(modules):
            raise ValueError(f"vanilla MTP unrolls one level per module: ttt_steps {ttt_steps} != {len(modules)}")
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
        self.mtp_modules = nn.ModuleList(modules)
        self.ttt_steps, self.feed_post_norm = ttt_steps, hidden_feedback == "post_norm"
        self.tv_weight = tv_weight  # see distill_level
        self._teacher = teacher  # not an nn.Module: its weights are not ours

    @property
    def vanilla(self) -> bool:
        return len(self.mtp_modules) > 1

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.mtp_modules.parameters())

    def forward(self, input_ids: torch.Tensor, teacher: TeacherOutputs) -> tuple[torch.Tensor, dict[str, float]]:
        """input_ids [B, S] -> (weighted loss [], {"loss", "acc0", "overlap0", ...})."""
        seq_len = input_ids.shape[1]
        total, metrics = 0.0, {}
        levels = self.unroll(teacher.hidden, input_ids)
        for j, (out, weight) in enumerate(zip(levels, level_weights(self.ttt_steps))):
            n = seq_len - j - 1  # chains t < n have their token t+j+1 and a target label
            if n <= 0:
                break
            logits = self._teacher.lm_head(self._module(j).shared_head["norm"](out[:, :n]))
            fit = distill_level(logits, teacher.logits[:, j + 1:], None, None, self.tv_weight)
            total = total + weight * fit.loss
            metrics[f"acc{j}"], metrics[f"overlap{j}"] = fit.accuracy.item(), fit.overlap.item()
        metrics["loss"] = float(total.detach())
        return total, metrics

    def unroll(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """hidden [B, S, H] the target's final-normed hidden, input_ids [B, S] -> each level's block output
        before shared_head.norm [B, S, H] (row t of level j predicts token t+j+2)."""
        cache, outputs = TTTCache(), []
        for j in range(self.ttt_steps):
            module = self._module(j)
            cache = TTTCache() if self.vanilla else cache  # vanilla: own KV layer, plain causal attention
            out = self._level(module, hidden, shift_ids(input_ids, j + 1), cache, 0 if self.vanilla else j)
            outputs.append(out)
            hidden = module.shared_head["norm"](out) if self.feed_post_norm else out
        return outputs

    def _module(self, level: int) -> MTPModule:
        return self.mtp_modules[level if self.vanilla else 0]

    def _level(self, module: MTPModule, hidden: torch.Tensor, ids: torch.Tensor, cache: TTTCache,
               position_offset: int) -> torch.Tensor:
        """hidden [B, S, H] (h_t or the fed-back output), ids [B, S] (token t+j+1 in row t) -> block output
        before shared_head.norm [B, S, H]."""
        embeds = self._teacher.decoder.embed_tokens(ids).to(hidden.dtype)
        x = module.eh_proj(torch.cat([module.enorm(embeds), module.hnorm(hidden)], dim=-1))
        positions = torch.arange(ids.shape[1], device=ids.device)[None] + position_offset
        position_embeddings = self._teacher.decoder.rotary_emb(x, positions)
        out = module.block(x, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings,
                           ttt_cache=cache)
        return out[0] if isinstance(out, tuple) else out

    def module_states(self, dtype: torch.dtype = torch.float32) -> list[dict[str, torch.Tensor]]:
        """Canonical weights of each module (``save_mtp_weights`` input), floats cast to ``dtype``, on the CPU."""
        return [{k: v.detach().to("cpu", dtype) for k, v in m.canonical_state().items()} for m in self.mtp_modules]
