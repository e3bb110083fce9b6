"""The training loop: exact resume after an interruption, the schedule, the wall-clock budget."""
import time

import pytest
import torch
from torch import nn

from tllm_spec.training.loop import STATE_FILE, LoopConfig, lr_at, run_loop

CPU = torch.device("cpu")


def make_step(model, interrupt_at=None):
    def step(i):
        if i == interrupt_at:
            raise KeyboardInterrupt
        g = torch.Generator().manual_seed(i)  # data from the step index, as sample_windows does
        x = torch.randn(8, 4, generator=g)
        noise = 0.1 * torch.randn(8, 1)  # global RNG: resume must restore it
        loss = ((model(x) - x.sum(-1, keepdim=True) - noise) ** 2).mean()
        return loss, {"loss": loss.item()}
    return step


def fresh():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def validation(model):
    x = torch.linspace(-1, 1, 32).view(8, 4)
    return lambda: ((model(x) - x.sum(-1, keepdim=True)) ** 2).mean().item()


def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(tmp_path):
    cfg = LoopConfig(max_steps=10, lr=1e-2, warmup_steps=2, save_every=0, eval_every=3)
    torch.manual_seed(1)
    whole = fresh()
    torch.manual_seed(1)
    expected = run_loop(whole, make_step(whole), cfg, CPU, None, progress=False, eval_fn=validation(whole))

    part = fresh()
    torch.manual_seed(1)
    with pytest.raises(KeyboardInterrupt):
        run_loop(part, make_step(part, interrupt_at=7), cfg, CPU, tmp_path, progress=False, eval_fn=validation(part))
    assert (tmp_path / STATE_FILE).is_file()
    torch.manual_seed(123)  # a different RNG state: resume must restore the saved one
    resumed = fresh()
    result = run_loop(resumed, make_step(resumed), cfg, CPU, tmp_path, resume=True, progress=False,
                      eval_fn=validation(resumed))
    assert result.step == 10 and len(result.losses) == 3 and result.best_step == expected.best_step
    for a, b in zip(whole.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_warmup_then_cosine_to_the_floor():
    cfg = LoopConfig(max_steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 100, cfg) == pytest.approx(0.1)
    assert lr_at(9, 100, cfg) == pytest.approx(1.0)
    assert lr_at(100, 100, cfg) == pytest.approx(0.1)
    assert lr_at(55, 100, cfg) == pytest.approx(0.55)  # half way through the cosine


def test_time_budget_shrinks_the_plan():
    model = fresh()
    inner = make_step(model)

    def slow_step(i):
        time.sleep(0.01)
        return inner(i)

    start = time.perf_counter()
    result = run_loop(model, slow_step, LoopConfig(max_steps=10_000, time_budget_s=0.5), CPU, None, progress=False)
    assert 10 < result.step < 200
    assert time.perf_counter() - start < 2.0


def test_early_stopping_keeps_the_best_weights():
    model = fresh()
    scores = iter([5.0, 3.0, 4.0, 6.0, 7.0, 8.0, 9.0])
    snapshots = []

    def eval_fn():
        snapshots.append([p.detach().clone() for p in model.parameters()])
        return next(scores)

    cfg = LoopConfig(max_steps=100, lr=1e-2, eval_every=2, patience=3)
    result = run_loop(model, make_step(model), cfg, CPU, None, progress=False, eval_fn=eval_fn)
    assert result.step == 10 and [s for s, _ in result.evals] == [2, 4, 6, 8, 10]  # 3 scores after the best
    assert result.best_step == 4
    for kept, best in zip(model.parameters(), snapshots[1]):
        assert torch.equal(kept, best)
