"""The reproducible recipe of the embedded demo pair (``scripts/build_demo_models.py``).

1. Corpus: every .py file under a Python standard library directory (default: the running Python's;
   site-packages excluded), sorted by path. The shipped pair uses CPython's full ``Lib`` with its test suite
   (~10M tokens; a distro Python without tests has ~3M). The 10th, 20th, ... file is held out for evaluation
   (listed with its opening text in ``heldout.json``); the 5th, 15th, ... file is the target's validation set.
2. A byte-level BPE tokenizer (``tokenizers``) trained on the training files (validation included).
3. A small Llama target trained from scratch: deep and narrow (per-layer overhead dominates a CPU decode step,
   so depth is what makes a one-layer draft cheap), one KV head, tied embeddings. Training keeps the weights
   of the lowest validation loss: a target that has memorised its corpus is erratic on new text, and what a
   draft predicts is the target's behaviour on new text.
4. Self-distillation data (:mod:`.rollout`): the target's own continuations of training prompts, half greedy,
   half sampled at T = 1 -- the text a draft meets at inference.
5. Its EAGLE-3 head (full vocabulary, training-time test over K = 3 levels) and one MTP module (trained chained:
   its own output fed back for 3 levels, as MTP-Eagle runs it), trained by :func:`train_draft` (the code
   behind ``scripts/train_draft.py``) on training text and rollouts, sharing the time the target left.
6. bf16 weights in ``demo/{target,eagle3,mtp}``, a CPU acceptance check (T = 0, and T = 1 with rejection
   sampling), packed as ``demo_assets.tgz.NNN``.
7. A draft LM for the draft_target mode (:mod:`.demo_draft_lm`, ``demo/draft``): a two-layer Llama of the
   target's vocabulary, its embedding projected from the target's, trained in its own share of the minutes on
   top of the others.
"""
from __future__ import annotations

import json
import platform
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ..tokenizer import load_tokenizer
from ..training.data import HELDOUT_EVERY, expand_paths, read_documents, split_heldout, stdlib_root, tokenize_documents
from ..training.draft import DraftTrainConfig, train_draft
from ..training.loop import LoopConfig
from ..training.rollout import generate_rollouts
from ..training.target import eval_loss, llama_config, save_target, train_target
from ..training.tokenizer import save_tokenizer, train_bpe_tokenizer
from .demo_assets import check_sizes, corpus_root, cpu_check, pack, write_heldout
from .demo_draft_lm import TINY_DRAFT_LM, DraftLMShape, draft_lm_phase

VALIDATION_POSITION = 5  # 1-based position (mod HELDOUT_EVERY) of the target's validation files
HELDOUT_RULE = (f"the {HELDOUT_EVERY}th, {2 * HELDOUT_EVERY}th, ... file of the sorted list of every .py file under "
                "the corpus root (site-packages excluded) is held out")


@dataclass(frozen=True)
class RecipeShape:
    """Model shapes and optimisation settings of the recipe."""

    vocab_size: int = 4096
    draft_vocab_size: int = 4096  # the full vocabulary: a 4096-row head costs nothing noticeable on a CPU step
    target: dict = field(default_factory=lambda: dict(
        hidden_size=192, intermediate_size=640, num_hidden_layers=16, num_attention_heads=3, num_key_value_heads=1,
        max_position_embeddings=2048))
    head_intermediate_size: int = 1024
    seq_len: int = 512
    target_batch: int = 64
    draft_batch: int = 32
    target_lr: float = 2e-3
    eagle3_lr: float = 2e-3
    mtp_lr: float = 1e-3
    ttt_steps: int = 3  # = K of the demo configs
    target_share: float = 0.45  # of the training minutes; the drafts split what the target leaves ...
    eagle3_share: float = 0.6  # ... the EAGLE-3 head this fraction, the MTP module the rest
    target_epochs: float = 20.0  # the cosine schedule's length, unless the time budget is shorter
    evals_per_epoch: int = 2  # validation scores per epoch ...
    patience: int = 4  # ... and how many may pass without improvement before the target stops
    draft_epochs: float = 40.0
    rollout_sequences: int = 4096  # self-distillation rollouts of seq_len tokens (half greedy, half T = 1)
    rollout_prompt_tokens: int = 64
    rollout_share: float = 0.5  # of each draft batch
    max_steps: int = 100_000
    prompt_chars: int = 1200  # opening text stored per held-out file
    check_prompts: int = 16  # held-out prompts of the CPU acceptance check
    draft_lm: DraftLMShape = field(default_factory=DraftLMShape)


TINY_SHAPE = RecipeShape(  # for the CPU test of the recipe
    vocab_size=300, draft_vocab_size=128, target=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                                      num_attention_heads=2, num_key_value_heads=1,
                                                      max_position_embeddings=256),
    head_intermediate_size=64, seq_len=32, target_batch=4, draft_batch=4, max_steps=4, rollout_sequences=8,
    rollout_prompt_tokens=8, prompt_chars=300, check_prompts=3, draft_lm=TINY_DRAFT_LM)


def build_demo_models(out: str | Path, workdir: str | Path, device: torch.device, minutes: float = 7.0,
                      shape: RecipeShape = RecipeShape(), files: list[Path] | None = None, progress: bool = True,
                      target_from: str | Path | None = None) -> dict:
    """Run the recipe; the pair lands in ``workdir/demo``, the packed parts and a report in ``out``.

    ``files``: the corpus (default: this Python's standard library). ``target_from``: a target (with its
    tokenizer) an earlier run of the recipe trained on the same corpus; its phase is skipped and the drafts get
    the whole budget."""
    out, demo_dir = Path(out), Path(workdir) / "demo"
    shutil.rmtree(demo_dir, ignore_errors=True)
    report: dict = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
                    "shape": asdict(shape), "minutes": minutes, "phases_s": {}}
    clock, budget = _Clock(report["phases_s"]), 60.0 * minutes
    corpus = files if files is not None else stdlib_corpus()
    train, heldout = split_heldout(corpus, HELDOUT_EVERY)
    validation = split_heldout(corpus, HELDOUT_EVERY, VALIDATION_POSITION)[1]
    fit = [f for f in train if f not in set(validation)]
    tokenizer = load_tokenizer(target_from) if target_from else train_bpe_tokenizer(read_documents(train),
                                                                                    shape.vocab_size)
    fit_tokens, val_tokens, held_tokens = (_tokenize(tokenizer, f) for f in (fit, validation, heldout))
    report.update(corpus_root=str(corpus_root(corpus)), train_files=len(fit), validation_files=len(validation),
                  heldout_files=len(heldout), train_tokens=int(fit_tokens.numel()),
                  validation_tokens=int(val_tokens.numel()), heldout_tokens=int(held_tokens.numel()))
    clock.lap("corpus+tokenizer")
    if target_from:
        shutil.copytree(target_from, demo_dir / "target")
        report["target"] = {"reused": str(target_from), "seconds": 0.0}
    else:
        report["target"] = _target_phase(shape, tokenizer, fit_tokens, val_tokens, held_tokens, demo_dir / "target",
                                         device, shape.target_share * budget, progress)
    write_heldout(demo_dir / "heldout.json", corpus, heldout, HELDOUT_RULE, shape.prompt_chars)
    clock.lap("target")
    stream = torch.cat([fit_tokens, val_tokens])  # the drafts train on every non-held-out file
    rollouts = _rollouts(shape, demo_dir / "target", stream, device)
    report["rollout_tokens"] = int(rollouts.numel())
    clock.lap("rollouts")
    budget -= report["phases_s"]["target"] + report["phases_s"]["rollouts"]
    for kind, share in (("eagle3", shape.eagle3_share), ("mtp", 1.0)):
        report[kind] = _draft_phase(kind, shape, demo_dir / "target", tuple(str(f) for f in corpus),
                                    (stream, held_tokens), rollouts, Path(workdir) / f"run-{kind}", demo_dir / kind,
                                    device, share * budget, progress)
        budget -= report[kind]["seconds"]
        clock.lap(kind)
    report["draft_lm"] = draft_lm_phase(shape.draft_lm, demo_dir / "target", stream, held_tokens,
                                        demo_dir / "heldout.json", demo_dir / "draft", device,
                                        shape.draft_lm.share * 60.0 * minutes, rollouts, progress)
    clock.lap("draft_lm")
    report["cpu_check"] = cpu_check(demo_dir, min(64, shape.seq_len), min(64, shape.seq_len), shape.check_prompts)
    clock.lap("cpu check")
    (demo_dir / "recipe.json").write_text(json.dumps(report, indent=2))
    report["sizes"] = check_sizes(demo_dir)
    report["packed"] = [str(p) for p in pack(demo_dir, out)]
    clock.lap("pack")
    (out / "build_report.json").write_text(json.dumps(report, indent=2))
    return report


def stdlib_corpus(root: str | Path | None = None, min_files: int = 200) -> list[Path]:
    """Every .py file under ``root`` (default: this Python's standard library), site-packages excluded, sorted."""
    root = Path(root) if root is not None else stdlib_root()
    files = expand_paths([root], suffixes=(".py",))
    if len(files) < min_files:
        raise RuntimeError(f"only {len(files)} .py files under {root}: the standard library sources are missing "
                           f"(the recipe needs at least {min_files})")
    return files


def _tokenize(tokenizer, files: list[Path]) -> torch.Tensor:
    if not files:
        return torch.zeros(0, dtype=torch.int32)
    return tokenize_documents(tokenizer, read_documents(files), tokenizer.eos_token_id)


def _epoch_steps(shape: RecipeShape, tokens: torch.Tensor, batch_size: int) -> float:
    return tokens.numel() / (batch_size * shape.seq_len)


def _target_phase(shape: RecipeShape, tokenizer, fit: torch.Tensor, val: torch.Tensor, held: torch.Tensor,
                  target_dir: Path, device: torch.device, budget_s: float, progress: bool) -> dict:
    config = llama_config(shape.vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id, **shape.target)
    epoch = _epoch_steps(shape, fit, shape.target_batch)
    loop = LoopConfig(max_steps=max(1, min(shape.max_steps, int(shape.target_epochs * epoch))), lr=shape.target_lr,
                      warmup_steps=200, weight_decay=0.1, time_budget_s=budget_s, patience=shape.patience,
                      eval_every=max(1, int(epoch / shape.evals_per_epoch)))
    model, result = train_target(config, fit, loop, shape.target_batch, shape.seq_len, device, progress=progress,
                                 val_stream=val if val.numel() > shape.seq_len else None)
    summary = {"steps": result.step, "seconds": round(result.seconds, 1), "epoch_steps": round(epoch, 1),
               "best_step": result.best_step, "validation_losses": [(s, round(v, 4)) for s, v in result.evals],
               "train_loss_last": round(sum(result.losses[-20:]) / len(result.losses[-20:]), 4)}
    if held.numel() > shape.seq_len:
        summary["heldout_loss"] = round(eval_loss(model, held, shape.target_batch, shape.seq_len, device), 4)
    save_target(model, target_dir)
    save_tokenizer(tokenizer, target_dir, config.max_position_embeddings)
    print(f"target: {summary}", flush=True)
    return summary


def _rollouts(shape: RecipeShape, target_dir: Path, stream: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[rollout_sequences, seq_len] int32: the target's continuations of training prompts (shared by both drafts)."""
    model = AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32).to(device)
    rollouts = generate_rollouts(model, stream, shape.rollout_sequences, shape.rollout_prompt_tokens, shape.seq_len,
                                 batch_size=1024 if device.type == "cuda" else 64)
    del model
    return rollouts


def _draft_phase(kind: str, shape: RecipeShape, target_dir: Path, data: tuple[str, ...],
                 streams: tuple[torch.Tensor, torch.Tensor], rollouts: torch.Tensor, run_dir: Path, dest: Path,
                 device: torch.device, budget_s: float, progress: bool) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    per_kind = dict(lr=shape.mtp_lr) if kind == "mtp" else dict(
        lr=shape.eagle3_lr, draft_vocab=shape.draft_vocab_size, intermediate_size=shape.head_intermediate_size)
    steps = max(1, min(shape.max_steps, int(shape.draft_epochs * _epoch_steps(shape, streams[0], shape.draft_batch))))
    cfg = DraftTrainConfig(
        target=str(target_dir), data=data, kind=kind, out=str(run_dir), suffixes=(".py",), heldout_every=HELDOUT_EVERY,
        steps=steps, batch_size=shape.draft_batch, seq_len=shape.seq_len, ttt_steps=shape.ttt_steps,
        rollout_sequences=rollouts.shape[0], rollout_prompt_tokens=shape.rollout_prompt_tokens,
        rollout_share=shape.rollout_share, time_budget_s=max(1.0, budget_s), save_every=0, device=str(device),
        progress=progress, **per_kind)
    summary = train_draft(cfg, streams, rollouts).summary
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "model.safetensors.index.json", "model-mtp.safetensors"):
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, dest / name)
    result = {k: summary[k] for k in ("steps", "seconds", "last_step", "heldout", "heldout_rollouts") if k in summary}
    print(f"{kind}: {result}", flush=True)
    return result


class _Clock:
    """Wall time of each phase, printed and recorded."""

    def __init__(self, record: dict[str, float]):
        self.record, self.last = record, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.record[phase] = round(now - self.last, 1)
        self.last = now
        print(f"[{phase}] {self.record[phase]:.1f} s", flush=True)
