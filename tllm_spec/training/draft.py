"""``train_draft``: train an EAGLE-3 head or MTP module(s) for a frozen HF target on local text / jsonl files,
and write them in the formats our loaders read (EAGLE dialect; DeepSeek-style MTP keys)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import AutoModelForCausalLM

from .. import demo
from ..drafts.eagle3_checkpoint import save_eagle3_checkpoint
from ..drafts.mtp_checkpoint import save_mtp_weights
from ..tokenizer import load_tokenizer
from .data import HELDOUT_EVERY, TEXT_SUFFIXES, eval_windows, expand_paths, read_documents, sample_windows, \
    split_heldout, tokenize_documents
from .eagle3 import Eagle3Trainer, default_aux_layers, head_config, init_head
from .loop import LoopConfig, autocast, run_loop
from .mtp import MTPTrainer, init_mtp_modules
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
    steps: int = Field(2000, ge=1, description="optimizer steps (an upper bound with time_budget_s)")
    batch_size: int = Field(16, ge=1)
    seq_len: int = Field(512, ge=8)
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(100, ge=0)
    ttt_steps: int = Field(3, ge=1, le=16, description="draft levels unrolled per chain (EAGLE-3 TTT, MTP-Eagle)")
    draft_vocab: int | None = Field(None, ge=2, description="EAGLE-3 draft vocabulary (most frequent tokens)")
    aux_layers: tuple[int, int, int] | None = Field(None, description="EAGLE-3: 0-based layers whose OUTPUT is "
                                                    "captured; default (1, L//2-1, L-4)")
    intermediate_size: int | None = Field(None, ge=1, description="EAGLE-3 head MLP width; default the target's")
    num_modules: int = Field(1, ge=1, le=8, description="MTP: >1 trains vanilla MTP (one level per module)")
    hidden_feedback: Literal["pre_norm", "post_norm"] = Field("post_norm", description="MTP: the hidden fed to "
                                                              "the next level (must match MTPConfig)")
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
        if self.kind == "mtp" and self.draft_vocab is not None:
            raise ValueError("draft_vocab: MTP modules share the target's lm_head (full vocabulary)")
        if self.kind == "mtp" and self.num_modules > 1 and self.ttt_steps not in (1, self.num_modules):
            raise ValueError("ttt_steps: vanilla MTP (num_modules > 1) unrolls exactly one level per module")
        if self.kind == "eagle3" and self.num_modules != 1:
            raise ValueError("num_modules applies to kind='mtp' only")
        return self


@dataclass
class DraftTrainResult:
    out: Path
    losses: list[float]  # per step, this run
    summary: dict


def train_draft(cfg: DraftTrainConfig, streams: tuple[torch.Tensor, torch.Tensor | None] | None = None
                ) -> DraftTrainResult:
    """Train, save the draft in its loader format, evaluate on the held-out files, write the summary.

    ``streams``: the (train, held-out) token streams of ``cfg.data``'s split when the caller already has them
    (the demo recipe); otherwise the files are read and tokenized here."""
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
    trainer, teacher = _build(cfg, model, stream, tokenizer.eos_token_id)
    trainer.train()

    def step_fn(step: int) -> tuple[torch.Tensor, dict[str, float]]:
        ids = sample_windows(stream, cfg.batch_size, cfg.seq_len, cfg.seed, step).to(device)
        return trainer(ids, teacher(ids))

    loop = LoopConfig(max_steps=cfg.steps, lr=cfg.lr, warmup_steps=cfg.warmup_steps, time_budget_s=cfg.time_budget_s,
                      save_every=cfg.save_every)
    result = run_loop(trainer, step_fn, loop, device, out, cfg.resume, desc=f"train {cfg.kind}",
                      progress=cfg.progress)
    _save(cfg, trainer, out, model.config.num_hidden_layers)
    heldout = evaluate(trainer, teacher, heldout_stream, cfg, device)
    summary = {"config": cfg.model_dump(mode="json"), "steps": result.step, "seconds": round(result.seconds, 1),
               "train_tokens": int(stream.numel()), "train_files": len(train_files),
               "heldout_files": [str(f) for f in heldout_files], "last_step": result.metrics, "heldout": heldout}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return DraftTrainResult(out, result.losses, summary)


def _build(cfg: DraftTrainConfig, model, stream: torch.Tensor, eos_token_id: int
           ) -> tuple[Eagle3Trainer | MTPTrainer, Teacher]:
    num_layers = model.config.num_hidden_layers
    if cfg.kind == "mtp":
        teacher = Teacher(model)
        return MTPTrainer(init_mtp_modules(teacher, cfg.num_modules, cfg.seed), teacher,
                          cfg.num_modules if cfg.num_modules > 1 else cfg.ttt_steps, cfg.hidden_feedback), teacher
    aux = tuple(cfg.aux_layers or default_aux_layers(num_layers))
    teacher = Teacher(model, aux)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    vocab = build_draft_vocab(token_counts(stream, vocab_size), cfg.draft_vocab or vocab_size, [eos_token_id])
    head = head_config(model.config, vocab.size, aux, cfg.intermediate_size)
    return Eagle3Trainer(init_head(head, teacher, vocab, cfg.seed), vocab, cfg.ttt_steps), teacher


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


@torch.no_grad()
def evaluate(trainer, teacher: Teacher, stream: torch.Tensor | None, cfg: DraftTrainConfig, device: torch.device,
             max_batches: int = 8) -> dict[str, float]:
    """Mean loss and per-level accuracy over consecutive held-out windows ({} when nothing is held out)."""
    if stream is None or stream.numel() <= cfg.seq_len:
        return {}
    trainer.eval()
    totals: dict[str, float] = {}
    batches = eval_windows(stream, cfg.batch_size, cfg.seq_len, max_batches)
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
