"""distill_level: the soft-label loss, the total-variation term and the T = 1 overlap proxy, against hand-computed
values on a 4-token vocabulary."""
import pytest
import torch

from tllm_spec.training.teacher import distill_level

# one position, full vocabulary: target p = (0.5, 0.3, 0.2, 0), draft q = (0.25, 0.25, 0.25, 0.25)
P = torch.tensor([0.5, 0.3, 0.2, 1e-30])
Q = torch.full((4,), 0.25)


def logits(probs: torch.Tensor) -> torch.Tensor:
    return probs.log().view(1, 1, -1)


def test_overlap_is_the_sampled_acceptance_probability():
    fit = distill_level(logits(Q), logits(P), None, None)
    assert fit.overlap.item() == pytest.approx(0.25 + 0.25 + 0.2)  # sum_i min(p_i, q_i)
    assert fit.accuracy.item() == 1.0  # argmax q (first of the ties) == argmax p
    assert fit.loss.item() == pytest.approx(-(P * Q.log()).sum().item())  # cross-entropy, no TV term


def test_tv_term_adds_weighted_rejection_probability():
    plain = distill_level(logits(Q), logits(P), None, None).loss
    with_tv = distill_level(logits(Q), logits(P), None, None, tv_weight=2.0).loss
    assert (with_tv - plain).item() == pytest.approx(2.0 * (1 - 0.7))


def test_tv_gradient_moves_the_draft_towards_the_target():
    draft = logits(Q).clone().requires_grad_(True)
    before = distill_level(draft, logits(P), None, None).overlap
    loss = distill_level(draft, logits(P), None, None, tv_weight=1.0).loss
    loss.backward()
    with torch.no_grad():
        draft -= 0.5 * draft.grad
    assert distill_level(draft, logits(P), None, None).overlap > before


def test_reduced_vocabulary_overlap_counts_the_unreachable_mass():
    # draft vocabulary = target ids 0 and 1; the target puts 0.2 on id 2, which no draft sample can be
    draft_ids, t2d = torch.tensor([0, 1]), torch.tensor([True, True, False, False])
    fit = distill_level(torch.tensor([[[0.0, 0.0]]]), logits(P), draft_ids, t2d)
    assert fit.overlap.item() == pytest.approx(0.5 + 0.3)  # min(0.5, 0.5) + min(0.3, 0.5)
    renormalised = P[:2] / P[:2].sum()
    assert fit.loss.item() == pytest.approx(-(renormalised * torch.tensor(0.5).log()).sum().item())


def test_reduced_vocabulary_far_below_the_target_argmax_stays_finite():
    # the target's mass sits on a token outside the draft vocabulary, 200 nats above every draft token
    draft_ids, t2d = torch.tensor([0, 1]), torch.tensor([True, True, False, False])
    target = torch.tensor([[[0.0, 1.0, 200.0, 0.0]]])
    fit = distill_level(torch.tensor([[[0.0, 0.0]]]), target, draft_ids, t2d, tv_weight=1.0)
    assert torch.isfinite(fit.loss) and fit.overlap.item() == pytest.approx(0.0, abs=1e-6)
