"""Temperature calibration of an EAGLE-3 head for sampled drafting.

At T > 0 a draft token sampled from q is accepted with probability sum_i min(p_i, q_i) (rejection sampling;
p the target's distribution). A head trained on the soft-label cross-entropy is mode-covering: its q is
broader than p, and a slightly sharper q overlaps p more. Calibration picks the logit temperature tau that
maximises the mean overlap over every level on the target's own T = 1 continuations, and folds 1 / tau into the
head's ``lm_head`` (the logits are linear in it). Greedy drafting is unchanged (the argmax does not move); the
rejection sampler stays exact because it verifies against the q the drafts are drawn from.
"""
from __future__ import annotations

import torch

from .eagle3 import Eagle3Trainer
from .loop import autocast
from .teacher import Teacher, distill_level

TEMPERATURES = (0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0, 1.1)


@torch.no_grad()
def overlap_by_temperature(trainer: Eagle3Trainer, teacher: Teacher, batches: list[torch.Tensor],
                           temperatures: tuple[float, ...] = TEMPERATURES) -> dict[float, float]:
    """{tau: mean over batches, levels and positions of sum_i min(p_i, softmax(z / tau)_i)}. batches: [b, S]."""
    was_training = trainer.training
    trainer.eval()
    device = trainer.draft.lm_head.weight.device
    totals = dict.fromkeys(temperatures, 0.0)
    for ids in batches:
        ids = ids.to(device)
        with autocast(device):
            outputs = teacher(ids)
            levels = trainer.level_logits(ids, outputs)
        for tau in temperatures:
            overlaps = [distill_level(logits.float() / tau, outputs.logits[:, j + 1:], trainer.draft_ids,
                                      trainer.t2d).overlap.item() for j, logits in enumerate(levels)]
            totals[tau] += sum(overlaps) / len(overlaps) / len(batches)
    trainer.train(was_training)
    return {tau: round(v, 5) for tau, v in totals.items()}


def calibrate_temperature(trainer: Eagle3Trainer, teacher: Teacher, batches: list[torch.Tensor]) -> dict:
    """Fold the best temperature of :func:`overlap_by_temperature` into the head; returns what was measured."""
    scores = overlap_by_temperature(trainer, teacher, batches)
    tau = max(scores, key=scores.get)
    with torch.no_grad():
        trainer.draft.lm_head.weight.div_(tau)
    return {"temperature": tau, "overlap": scores}
