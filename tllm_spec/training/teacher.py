"""The frozen target as the teacher: hidden states computed on the fly, and the soft-label loss.

One no-grad target forward gives what every draft kind needs: the final-normed hidden (MTP), the outputs of
the captured decoder layers (EAGLE-3's aux features, through forward hooks) and the logits (soft labels).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TeacherOutputs:
    hidden: torch.Tensor  # [B, S, H] final-normed hidden state
    aux: torch.Tensor | None  # [B, S, n*H] captured layer outputs, low -> high layer
    logits: torch.Tensor  # [B, S, V]


class Teacher:
    """Runs a frozen HF causal LM; ``capture`` = 0-based decoder layers whose OUTPUT is captured (the residual
    stream entering the next layer: ``output_hidden_states`` entry i + 1)."""

    def __init__(self, model: nn.Module, capture: tuple[int, ...] = ()):
        self.model = model.eval().requires_grad_(False)
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.capture = tuple(sorted(capture))
        self._captured: dict[int, torch.Tensor] = {}
        for i in self.capture:
            self.decoder.layers[i].register_forward_hook(self._hook(i))

    @property
    def config(self):
        return self.model.config

    def _hook(self, layer: int):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
            self._captured[layer] = output[0] if isinstance(output, tuple) else output
        return hook

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> TeacherOutputs:
        """input_ids [B, S] int64 -> hidden, aux features and logits of every position."""
        self._captured.clear()
        hidden = self.decoder(input_ids=input_ids, use_cache=False).last_hidden_state
        aux = torch.cat([self._captured[i] for i in self.capture], dim=-1) if self.capture else None
        self._captured.clear()
        return TeacherOutputs(hidden, aux, self.lm_head(hidden))


@dataclass(frozen=True)
class LevelFit:
    loss: torch.Tensor  # [] what is trained
    accuracy: torch.Tensor  # [] draft argmax == target argmax: the greedy acceptance proxy
    overlap: torch.Tensor  # [] mean sum_i min(p_i, q_i): the acceptance probability of a T = 1 draft sample


def distill_level(draft_logits: torch.Tensor, target_logits: torch.Tensor, draft_ids: torch.Tensor | None,
                  t2d: torch.Tensor | None, tv_weight: float = 0.0) -> LevelFit:
    """Soft-label cross-entropy of one draft level against the target's distribution, plus ``tv_weight`` times
    the total-variation distance (the rejection probability of rejection sampling at T = 1, trained directly;
    with a reduced draft vocabulary, against the renormalised target, like the cross-entropy).

    draft_logits [B, N, Vd] (draft vocabulary); target_logits [B, N, V] for the same predicted tokens;
    draft_ids [Vd] (target id of each draft id) and t2d [V] bool, or None when Vd == V. As in EAGLE-3 /
    SpecForge the target distribution is renormalised over the draft vocabulary for the loss, and positions
    whose target argmax has no draft id are left out of it. The accuracy and the overlap count every position,
    the overlap against the target's full distribution (its mass outside the draft vocabulary is never met).
    """
    target_top = target_logits.argmax(-1)  # [B, N]
    keep = torch.ones_like(target_top, dtype=torch.bool) if t2d is None else t2d[target_top]
    target_logits = target_logits.float()
    p = F.softmax(target_logits, dim=-1)  # the target's full distribution, read on the draft vocabulary
    p_draft = p if draft_ids is None else F.softmax(target_logits[..., draft_ids], dim=-1)  # renormalised
    if draft_ids is not None:
        p = p[..., draft_ids]
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    per_position = -(p_draft * log_q).sum(-1)  # [B, N]
    overlap = torch.minimum(p, log_q.exp()).sum(-1)  # [B, N]
    if tv_weight:
        per_position = per_position + tv_weight * (1 - torch.minimum(p_draft, log_q.exp()).sum(-1))
    loss = (per_position * keep).sum() / keep.sum().clamp(min=1)
    draft_top = draft_logits.argmax(-1)
    if draft_ids is not None:
        draft_top = draft_ids[draft_top]
    return LevelFit(loss, (draft_top == target_top).float().mean(), overlap.detach().mean())


def shift_ids(input_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """[B, S] -> [B, S] with row t holding token t + shift (zero-padded at the end)."""
    return F.pad(input_ids[:, shift:], (0, shift))


def level_weights(num_levels: int, decay: float = 0.8) -> list[float]:
    """Loss weight of each unrolled level: decay ** j (EAGLE-3 / SpecForge use 0.8)."""
    return [decay ** j for j in range(num_levels)]
