"""``train_draft``: train an EAGLE-3 head or MTP module(s) for a frozen HF target on local text / jsonl files,
and write them in the formats our loaders read (EAGLE dialect; DeepSeek-style MTP keys)."""
from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import AutoModelForCausalLM

from .. import demo
from ..drafts.eagle3.checkpoint import save_eagle3_checkpoint
from ..drafts.eagle3.model import resolve_capture_layers
from ..drafts.mtp.checkpoint import load_mtp_checkpoint, save_mtp_weights
from ..tokenizer import load_tokenizer
from .calibration import calibrate_temperature
from .data import (
    HELDOUT_EVERY,
    TEXT_SUFFIXES,
    eval_windows,
    expand_paths,
    read_documents,
    sample_rows,
    sample_windows,
    split_heldout,
    tokenize_documents,
)
from .eagle3 import (
    Eagle3Trainer,
    default_aux_layers,
    head_config,
    head_from_checkpoint,
    init_head,
    load_head,
    widen_mlp,
)
from .loop import LoopConfig, LoopResult, autocast, run_loop
from .mtp import MTPTrainer, init_mtp_modules
from .rollout import generate_rollouts
from .teacher import Teacher
from .vocab import build_draft_vocab, token_counts

SUMMARY_FILE = "training_summary.json"


class DraftTrainConfig(BaseModel):
    """Everything ``train_draft`` needs (``scripts/train_draft.py`` flags map 1:1 onto these fields)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target: str = Field(description="HF causal-LM directory (or demo://target); frozen during training")
    data: tuple[str, ...] = Field(min_length=1, description="text / jsonl files and directories")
    kind: Literal["eagle3", "mtp"] = "eagle3"
    out: str = Field(description="output directory: the head / MTP weights, trainer_state.pt, summary")
    steps: int = Field(2000, ge=0, description="optimizer steps (an upper bound with time_budget_s); 0 with "
                       "init_from: no training (calibrate or evaluate an existing draft)")
    batch_size: int = Field(16, ge=1)
    seq_len: int = Field(512, ge=8)
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(100, ge=0)
    ttt_steps: int = Field(3, ge=1, le=16, description="draft levels unrolled per chain (EAGLE-3 TTT, MTP-Eagle)")
    draft_vocab: int | None = Field(None, ge=2, description="EAGLE-3 draft vocabulary (most frequent tokens)")
    aux_layers: tuple[int, int, int] | None = Field(None, description="EAGLE-3: 0-based layers whose OUTPUT is "
                                                    "captured; default (1, L//2-1, L-4)")
    intermediate_size: int | None = Field(None, ge=1, description="EAGLE-3 head MLP width; default the target's. "
                                          "With init_from: widen the existing head's MLP to this many units "
                                          "(the new ones start silent)")
    init_from: str | None = Field(None, description="fine-tune this existing head / MTP directory instead of a "
                                  "fresh draft (its vocabulary and aux layers are kept, and its shape unless "
                                  "intermediate_size widens it)")
    num_modules: int = Field(1, ge=1, le=8, description="MTP: >1 trains vanilla MTP (one level per module)")
    hidden_feedback: Literal["pre_norm", "post_norm"] = Field("post_norm", description="MTP: the hidden fed to "
                                                              "the next level (must match MTPConfig)")
    rollout_sequences: int = Field(0, ge=0, description="self-distillation: target continuations of training "
                                   "prompts generated before training, split evenly over rollout_temperatures "
                                   "(0: none)")
    rollout_temperatures: tuple[float, ...] = Field((0.0, 1.0), min_length=1, description="the sampling "
                                                    "temperature of each equal share of the rollouts (0: greedy); "
                                                    "(0, 1, 1) weights the draft towards sampled text")
    rollout_prompt_tokens: int = Field(64, ge=1, description="prompt length of each rollout")
    rollout_share: float = Field(0.5, ge=0.0, le=1.0, description="fraction of each batch drawn from the rollouts")
    rollouts_file: str | None = Field(None, description="read the rollouts from this file if it exists (they must "
                                      "match rollout_sequences and seq_len), else generate and write them there")
    tv_weight: float = Field(0.0, ge=0.0, description="weight of a total-variation term added to the soft-label "
                             "loss: it trains the acceptance of rejection sampling at T = 1 directly")
    calibrate_temperature: bool = Field(False, description="EAGLE-3: after training, fold into the head the logit "
                                        "temperature that maximises its overlap with the target on T = 1 "
                                        "continuations (sampled drafts are accepted more; argmax unchanged)")
    heldout_every: int = Field(HELDOUT_EVERY, ge=0, description="hold out every Nth file (0: none)")
    suffixes: tuple[str, ...] = TEXT_SUFFIXES
    save_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    time_budget_s: float | None = Field(None, gt=0, description="wall-clock training budget")
    save_every: int = Field(500, ge=0)
    resume: bool = False
    device: str = "auto"
    seed: int = 0
    progress: bool = True

    @model_validator(mode="after")
    def _check(self) -> DraftTrainConfig:
        if self.steps == 0 and not self.init_from:
            raise ValueError("steps=0 trains nothing: it needs init_from (an existing draft to calibrate or evaluate)")
        if self.calibrate_temperature and self.kind != "eagle3":
            raise ValueError("calibrate_temperature applies to EAGLE-3 heads (MTP modules share the target's lm_head)")
        if self.init_from and self.draft_vocab is not None:
            raise ValueError("init_from keeps the existing draft's vocabulary: leave draft_vocab unset")
        if self.init_from and self.intermediate_size is not None and self.kind != "eagle3":
            raise ValueError("init_from with intermediate_size widens an EAGLE-3 head's MLP; MTP modules keep "
                             "their shape")
        if self.kind == "mtp" and self.draft_vocab is not None:
            raise ValueError("draft_vocab: MTP modules share the target's lm_head (full vocabulary)")
        if self.kind == "mtp" and self.num_modules > 1 and self.ttt_steps not in (1, self.num_modules):
            raise ValueError("ttt_steps: vanilla MTP (num_modules > 1) unrolls exactly one level per module")
        if self.kind == "eagle3" and self.num_modules != 1:
            raise ValueError("num_modules applies to kind='mtp' only")
        if any(t < 0 for t in self.rollout_temperatures):
            raise ValueError(f"rollout_temperatures {self.rollout_temperatures}: temperatures are >= 0 (0: greedy)")
        if self.rollout_sequences and self.rollout_prompt_tokens >= self.seq_len:
            raise ValueError(f"rollout_prompt_tokens {self.rollout_prompt_tokens} must be < seq_len {self.seq_len}")
        return self


@dataclass
class DraftTrainResult:
    out: Path
    losses: list[float]  # per step, this run
    summary: dict


def train_draft(cfg: DraftTrainConfig, streams: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                rollouts: torch.Tensor | None = None) -> DraftTrainResult:
    """Train, save the draft in its loader format, evaluate on the held-out files, write the summary.

    ``streams``: the (train, held-out) token streams of ``cfg.data``'s split when the caller already has them
    (the demo recipe); otherwise the files are read and tokenized here. ``rollouts`` [N, seq_len]: the target's
    continuations when the caller already generated them; otherwise ``cfg.rollout_sequences`` are generated."""
    device = _device(cfg.device)
    out = Path(cfg.out)
    target_dir = demo.resolve(cfg.target)
    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None or tokenizer.eos_token_id is None:
        raise ValueError(f"{target_dir}: training from text needs the target's tokenizer (with an EOS token)")
    train_files, heldout_files = split_heldout(expand_paths(cfg.data, cfg.suffixes), cfg.heldout_every)
    stream, heldout_stream = streams or (_tokenize(tokenizer, train_files), _tokenize(tokenizer, heldout_files))
    model = AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32).to(device)
    if rollouts is None and cfg.rollout_sequences:
        rollouts = _rollouts(cfg, model, stream, target_dir)
    num_rollout_rows = round(cfg.batch_size * cfg.rollout_share) if rollouts is not None else 0
    trainer, teacher = _build(cfg, model, stream, tokenizer.eos_token_id)
    trainer.train()

    def step_fn(step: int) -> tuple[torch.Tensor, dict[str, float]]:
        ids = _batch(stream, rollouts, cfg.batch_size - num_rollout_rows, num_rollout_rows, cfg, step).to(device)
        return trainer(ids, teacher(ids))

    if cfg.steps:
        loop = LoopConfig(max_steps=cfg.steps, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                          time_budget_s=cfg.time_budget_s, save_every=cfg.save_every)
        result = run_loop(trainer, step_fn, loop, device, out, cfg.resume, desc=f"train {cfg.kind}",
                          progress=cfg.progress)
    else:
        result = LoopResult(0)
    calibration = _calibrate(cfg, trainer, teacher, model, stream) if cfg.calibrate_temperature else None
    _save(cfg, trainer, out, model.config.num_hidden_layers)
    summary = {"config": cfg.model_dump(mode="json"), "steps": result.step, "seconds": round(result.seconds, 1),
               "train_tokens": int(stream.numel()), "train_files": len(train_files),
               "rollout_tokens": 0 if rollouts is None else int(rollouts.numel()),
               "heldout_files": [str(f) for f in heldout_files], "last_step": result.metrics,
               "heldout": evaluate(trainer, teacher, _heldout_batches(heldout_stream, cfg), device)}
    if calibration is not None:
        summary["calibration"] = calibration
    if rollouts is not None and heldout_stream is not None and heldout_stream.numel() > cfg.seq_len:
        # the target's continuations of held-out prompts: the text the draft meets in the acceptance evaluation
        held_rollouts = generate_rollouts(model, heldout_stream, 2 * cfg.batch_size, cfg.rollout_prompt_tokens,
                                          cfg.seq_len, seed=cfg.seed + 1)
        summary["heldout_rollouts"] = evaluate(trainer, teacher, list(held_rollouts.long().split(cfg.batch_size)),
                                               device)
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return DraftTrainResult(out, result.losses, summary)


def _rollouts(cfg: DraftTrainConfig, model, stream: torch.Tensor, target_dir: Path) -> torch.Tensor:
    """[rollout_sequences, seq_len] int32: read from cfg.rollouts_file when it was made with these settings,
    or generated (and written there)."""
    path = Path(cfg.rollouts_file) if cfg.rollouts_file else None
    settings = {"target": str(Path(target_dir).resolve()), "seed": cfg.seed,
                "prompt_tokens": cfg.rollout_prompt_tokens, "shape": [cfg.rollout_sequences, cfg.seq_len],
                "temperatures": list(cfg.rollout_temperatures)}
    if path is not None and path.is_file():
        return _read_rollouts(path, settings)
    rollouts = generate_rollouts(model, stream, cfg.rollout_sequences, cfg.rollout_prompt_tokens, cfg.seq_len,
                                 temperatures=cfg.rollout_temperatures, seed=cfg.seed)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"rollouts": rollouts, **settings}, path)
    return rollouts


def _read_rollouts(path: Path, settings: dict) -> torch.Tensor:
    """[rollout_sequences, seq_len] int32 from ``path``, refused unless made with ``settings``. The file holds a
    dict of a tensor, str, int and lists, read weights-only: a file that would unpickle anything else (code) is
    refused, not run."""
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{path}: refused: it holds objects other than tensors and plain values (unpickling them "
                         "could run code); delete the file to regenerate the rollouts") from None
    if isinstance(stored, dict):
        stored.setdefault("temperatures", [0.0, 1.0])  # files from before the setting: half greedy, half T = 1
    made_with = {k: stored.get(k) for k in settings} if isinstance(stored, dict) else None
    if made_with != settings:
        raise ValueError(f"{path}: rollouts made with {made_with}, this run needs {settings}: delete the file "
                         "or match the settings")
    return stored["rollouts"]


def _calibrate(cfg: DraftTrainConfig, trainer: Eagle3Trainer, teacher: Teacher, model, stream: torch.Tensor
               ) -> dict:
    """Temperature calibration on the target's T = 1 continuations of training prompts (not held-out text)."""
    prompt_tokens = min(cfg.rollout_prompt_tokens, cfg.seq_len // 2)
    continuations = generate_rollouts(model, stream, 4 * cfg.batch_size, prompt_tokens, cfg.seq_len,
                                      temperatures=(1.0,), seed=cfg.seed + 2)
    return calibrate_temperature(trainer, teacher, list(continuations.long().split(cfg.batch_size)))


def _batch(stream: torch.Tensor, rollouts: torch.Tensor | None, num_text_rows: int, num_rollout_rows: int,
           cfg: DraftTrainConfig, step: int) -> torch.Tensor:
    """[batch_size, seq_len] int64: random windows of the training text, then random rollouts."""
    parts = [sample_windows(stream, num_text_rows, cfg.seq_len, cfg.seed, step)] if num_text_rows else []
    if num_rollout_rows:
        parts.append(sample_rows(rollouts, num_rollout_rows, cfg.seed, step))
    return torch.cat(parts)


def _build(cfg: DraftTrainConfig, model, stream: torch.Tensor, eos_token_id: int
           ) -> tuple[Eagle3Trainer | MTPTrainer, Teacher]:
    num_layers = model.config.num_hidden_layers
    if cfg.kind == "mtp":
        teacher = Teacher(model)
        modules = init_mtp_modules(teacher, cfg.num_modules, cfg.seed)
        if cfg.init_from:
            ckpt = load_mtp_checkpoint(demo.resolve(cfg.init_from), num_layers, cfg.num_modules)
            for i, (module, state) in enumerate(zip(modules, ckpt.modules)):
                module.load_canonical(state, lambda key, i=i: ckpt.disk_name(i, key))
        return MTPTrainer(modules, teacher, cfg.num_modules if cfg.num_modules > 1 else cfg.ttt_steps,
                          cfg.hidden_feedback, cfg.tv_weight), teacher
    if cfg.init_from:
        ckpt, vocab = load_head(demo.resolve(cfg.init_from), model)
        if cfg.intermediate_size is not None:
            ckpt = widen_mlp(ckpt, cfg.intermediate_size, cfg.seed)
        teacher = Teacher(model, resolve_capture_layers(cfg.aux_layers, ckpt.config.aux_layer_ids, num_layers))
        return Eagle3Trainer(head_from_checkpoint(ckpt, teacher), vocab, cfg.ttt_steps, cfg.tv_weight), teacher
    aux = tuple(cfg.aux_layers or default_aux_layers(num_layers))
    teacher = Teacher(model, aux)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    vocab = build_draft_vocab(token_counts(stream, vocab_size), cfg.draft_vocab or vocab_size, [eos_token_id])
    head = head_config(model.config, vocab.size, aux, cfg.intermediate_size)
    return Eagle3Trainer(init_head(head, teacher, vocab, cfg.seed), vocab, cfg.ttt_steps, cfg.tv_weight), teacher


def _save(cfg: DraftTrainConfig, trainer: Eagle3Trainer | MTPTrainer, out: Path, num_target_layers: int) -> None:
    dtype = getattr(torch, cfg.save_dtype)
    if isinstance(trainer, Eagle3Trainer):
        save_eagle3_checkpoint(out, trainer.checkpoint(dtype), dialect="eagle")
        return
    for stale in [out / "model.safetensors.index.json", *out.glob("model-mtp*.safetensors")]:
        stale.unlink(missing_ok=True)  # save_mtp_weights appends a shard: start from an empty directory
    save_mtp_weights(out, trainer.module_states(dtype), "deepseek", num_target_layers=num_target_layers)


def _tokenize(tokenizer, files: list[Path]) -> torch.Tensor | None:
    return tokenize_documents(tokenizer, read_documents(files), tokenizer.eos_token_id) if files else None


def _heldout_batches(stream: torch.Tensor | None, cfg: DraftTrainConfig, max_batches: int = 8
                     ) -> list[torch.Tensor]:
    if stream is None or stream.numel() <= cfg.seq_len:
        return []
    return eval_windows(stream, cfg.batch_size, cfg.seq_len, max_batches)


@torch.no_grad()
def evaluate(trainer, teacher: Teacher, batches: list[torch.Tensor], device: torch.device) -> dict[str, float]:
    """Mean loss and per-level accuracy over ``batches`` [b, seq_len] ({} when there are none)."""
    if not batches:
        return {}
    trainer.eval()
    totals: dict[str, float] = {}
    for ids in batches:
        ids = ids.to(device)
        with autocast(device):
            _, metrics = trainer(ids, teacher(ids))
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v / len(batches)
    trainer.train()
    return {k: round(v, 4) for k, v in totals.items()}


def _device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
