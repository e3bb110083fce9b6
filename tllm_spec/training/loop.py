"""The training loop shared by the target and the draft trainers: AdamW, warmup + cosine schedule, a wall-clock
budget, optional early stopping on a validation score (the best weights are restored), a tqdm bar with the loss
and per-level draft accuracy, and resumable state (trainable weights, optimizer, step, RNG, best score) in one
``trainer_state.pt``."""
from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from tqdm.auto import tqdm

StepFn = Callable[[int], tuple[torch.Tensor, dict[str, float]]]  # step -> (loss [], metrics)
EvalFn = Callable[[], float]  # validation score, lower is better
STATE_FILE = "trainer_state.pt"


class LoopConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_steps: int = Field(1000, ge=1, description="optimizer steps (upper bound when a time budget is set)")
    lr: float = Field(1e-3, gt=0, description="peak learning rate")
    warmup_steps: int = Field(50, ge=0, description="linear warmup steps (capped at a tenth of the plan)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="max global grad norm")
    time_budget_s: float | None = Field(None, gt=0, description="wall-clock budget: the plan shrinks to fit")
    save_every: int = Field(0, ge=0, description="write trainer_state.pt every N steps (0: only at the end)")
    eval_every: int = Field(0, ge=0, description="score the validation set every N steps (0: never)")
    patience: int = Field(0, ge=0, description="stop after this many scores without improvement (0: never)")


@dataclass
class LoopResult:
    step: int  # optimizer steps done in total (this run and resumed ones)
    losses: list[float] = field(default_factory=list)  # this run's per-step losses
    metrics: dict[str, float] = field(default_factory=dict)  # the last step's
    seconds: float = 0.0  # wall time of this run
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, validation score) of this run
    best_step: int | None = None  # the step whose weights were kept (with an eval_fn)


def autocast(device: torch.device):
    """bf16 autocast on CUDA, nothing on CPU (fp32 there)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lr_at(step: int, planned: int, cfg: LoopConfig) -> float:
    """Linear warmup to cfg.lr, then cosine down to cfg.lr * min_lr_ratio at step ``planned``."""
    warmup = min(cfg.warmup_steps, planned // 10)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, planned - warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def run_loop(module: nn.Module, step_fn: StepFn, cfg: LoopConfig, device: torch.device, state_dir: Path | None,
             resume: bool = False, desc: str = "train", progress: bool = True, eval_fn: EvalFn | None = None
             ) -> LoopResult:
    """Train ``module``'s parameters that require grad with ``step_fn``; resume from ``state_dir`` if asked.
    With ``eval_fn`` and ``cfg.eval_every``, the best-scoring weights are the ones left in ``module``."""
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(params.values(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                  **({"fused": True} if device.type == "cuda" else {}))
    plan = _Plan(cfg.max_steps, cfg.time_budget_s)
    best = _Best(params, cfg.patience) if eval_fn is not None and cfg.eval_every else None
    step = _load_state(state_dir, params, optimizer, plan, best) if resume else 0
    result = LoopResult(step)
    start = time.perf_counter()
    bar = tqdm(total=plan.planned, initial=step, desc=desc, disable=not progress, dynamic_ncols=True,
               mininterval=0.1 if sys.stderr.isatty() else 15.0)  # a log file gets a line every 15 s
    try:
        while step < plan.planned:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, plan.planned, cfg)
            with autocast(device):
                loss, metrics = step_fn(step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params.values(), cfg.grad_clip)
            optimizer.step()
            step += 1
            result.losses.append(metrics.get("loss", loss.item()))
            result.metrics = metrics
            if plan.update(step, time.perf_counter() - start):
                bar.total = plan.planned
            if best is not None and (step % cfg.eval_every == 0 or step == plan.planned):
                result.evals.append((step, eval_fn()))
                if best.update(step, result.evals[-1][1]):  # out of patience: stop here
                    plan.planned = bar.total = step
            bar.set_postfix_str(_postfix(metrics, optimizer.param_groups[0]["lr"], best), refresh=False)
            bar.update(1)
            if state_dir is not None and cfg.save_every and step % cfg.save_every == 0:
                _save_state(state_dir, step, params, optimizer, plan, time.perf_counter() - start, best)
    except KeyboardInterrupt:
        if state_dir is not None:
            _save_state(state_dir, step, params, optimizer, plan, time.perf_counter() - start, best)
            print(f"\ninterrupted at step {step}; state saved in {state_dir / STATE_FILE} (continue with --resume)")
        raise
    finally:
        bar.close()
    result.step, result.seconds = step, time.perf_counter() - start
    if state_dir is not None:
        _save_state(state_dir, step, params, optimizer, plan, result.seconds, best)
    if best is not None and best.state is not None:
        best.restore()
        result.best_step = best.step
    return result


class _Best:
    """The best validation score so far and a copy of the weights that reached it."""

    def __init__(self, params: dict[str, nn.Parameter], patience: int):
        self._params, self.patience = params, patience
        self.value, self.step, self.bad = math.inf, 0, 0
        self.state: dict[str, torch.Tensor] | None = None

    def update(self, step: int, value: float) -> bool:
        """Record a score; returns True when training should stop (``patience`` scores without improvement)."""
        if value < self.value:
            self.value, self.step, self.bad = value, step, 0
            self.state = {n: p.detach().clone() for n, p in self._params.items()}
            return False
        self.bad += 1
        return bool(self.patience) and self.bad >= self.patience

    def restore(self) -> None:
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(self.state[name])

    def to_state(self) -> dict:
        return {"value": self.value, "step": self.step, "bad": self.bad, "state": self.state}

    def load(self, saved: dict) -> None:
        self.value, self.step, self.bad = saved["value"], saved["step"], saved["bad"]
        if saved["state"] is not None:
            self.state = {n: t.to(self._params[n].device) for n, t in saved["state"].items()}


class _Plan:
    """How many steps to run: ``max_steps``, shrunk once to fit the time budget after a few timed steps."""

    def __init__(self, max_steps: int, budget_s: float | None):
        self.planned, self.budget_s = max_steps, budget_s
        self.elapsed_before = 0.0  # seconds spent in earlier (resumed) runs
        self._first: tuple[int, float] | None = None  # (step, time) after the warm-up steps
        self._calibrated = False

    def update(self, step: int, elapsed: float) -> bool:
        """Called after each step; returns True when the plan changed."""
        if self.budget_s is None:
            return False
        if self.elapsed_before + elapsed > self.budget_s and self.planned > step:  # slower than estimated: stop
            self.planned = step
            return True
        if self._calibrated:
            return False
        if self._first is None:
            self._first = (step, elapsed) if step >= 3 else None  # skip warm-up (allocator, kernel selection)
            return False
        done = step - self._first[0]
        if done < 10 and elapsed < 0.1 * self.budget_s:
            return False
        per_step = (elapsed - self._first[1]) / done
        remaining = self.budget_s - self.elapsed_before - elapsed
        self.planned = max(step, min(self.planned, step + int(remaining / per_step)))
        self._calibrated = True
        return True


def _postfix(metrics: dict[str, float], lr: float, best: _Best | None) -> str:
    accs, overlaps = ("/".join(f"{metrics[k]:.2f}" for k in sorted(metrics) if k.startswith(p))
                      for p in ("acc", "overlap"))
    text = (f"loss={metrics.get('loss', float('nan')):.3f}" + (f" acc={accs}" if accs else "")
            + (f" ov={overlaps}" if overlaps else "") + f" lr={lr:.1e}")
    return text + (f" val={best.value:.3f}@{best.step}" if best is not None and best.state is not None else "")


def _save_state(state_dir: Path, step: int, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer,
                plan: _Plan, seconds: float, best: _Best | None) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "planned": plan.planned, "elapsed": plan.elapsed_before + seconds,
             "model": {n: p.detach().cpu() for n, p in params.items()}, "optimizer": optimizer.state_dict(),
             "rng_cpu": torch.get_rng_state(), "best": best.to_state() if best is not None else None,
             "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    tmp = state_dir / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(state_dir / STATE_FILE)  # never leave a half-written state behind


def _load_state(state_dir: Path | None, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer,
                plan: _Plan, best: _Best | None) -> int:
    file = None if state_dir is None else state_dir / STATE_FILE
    if file is None or not file.is_file():
        raise FileNotFoundError(f"--resume: no {STATE_FILE} in {state_dir}")
    state = torch.load(file, map_location="cpu", weights_only=True)
    if set(state["model"]) != set(params):
        raise ValueError(f"{file}: saved parameters {sorted(state['model'])[:4]}... do not match this model's "
                         f"{sorted(params)[:4]}... (different --kind or shape?)")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state["model"][name])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    plan.elapsed_before = state["elapsed"]
    if best is not None and state["best"] is not None:
        best.load(state["best"])
    if plan.budget_s is not None:  # keep the plan the budget produced, unless max_steps now asks for fewer
        plan.planned, plan._calibrated = min(plan.planned, state["planned"]), True
    return int(state["step"])
