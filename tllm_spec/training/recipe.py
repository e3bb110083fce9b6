"""The reproducible recipe of the embedded demo pair (``scripts/build_demo_models.py``).

1. Corpus: every .py file of the running Python's standard library (site-packages excluded), sorted by path;
   the 10th, 20th, ... file is held out for evaluation (listed, with its opening text, in ``heldout.json``).
2. A byte-level BPE tokenizer (``tokenizers``) trained on the training files.
3. A small Llama target trained from scratch: deep and narrow (per-layer overhead dominates a CPU decode
   step, so depth is what makes a one-layer draft cheap), one KV head, tied embeddings.
4. Its EAGLE-3 head and one MTP module, trained by :func:`train_draft` (the code behind
   ``scripts/train_draft.py``) on the same training files.
5. bf16 weights in ``assets/demo/{target,eagle3,mtp}``, packed as ``demo_assets.tgz.NNN`` parts for transport.
"""
from __future__ import annotations

import io
import json
import os
import platform
import shutil
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..config import Eagle3Config, MTPConfig
from .data import HELDOUT_EVERY, read_documents, split_heldout, stdlib_files, stdlib_root, tokenize_documents
from .draft import DraftTrainConfig, train_draft
from .loop import LoopConfig
from .target import eval_loss, llama_config, save_target, train_target
from .tokenizer import save_tokenizer, train_bpe_tokenizer

MAX_BYTES = 25_000_000  # the whole shipped pair
MAX_FILE_BYTES = 15_000_000  # any single file, shipped or packed
PACK_NAME = "demo_assets.tgz"
PHASE_SHARE = {"target": 0.55, "eagle3": 0.27, "mtp": 0.18}  # of the training minutes


@dataclass(frozen=True)
class RecipeShape:
    """Model shapes and optimisation settings of the recipe."""

    vocab_size: int = 4096
    draft_vocab_size: int = 2048
    target: dict = field(default_factory=lambda: dict(
        hidden_size=192, intermediate_size=640, num_hidden_layers=16, num_attention_heads=3, num_key_value_heads=1,
        max_position_embeddings=2048))
    head_intermediate_size: int = 640
    seq_len: int = 512
    target_batch: int = 64
    draft_batch: int = 32
    target_lr: float = 2e-3
    eagle3_lr: float = 2e-3
    mtp_lr: float = 1e-3
    ttt_steps: int = 3
    max_steps: int = 100_000  # the time budget ends each phase first
    prompt_chars: int = 1200  # opening text stored per held-out file


TINY_SHAPE = RecipeShape(  # for the CPU test of the recipe
    vocab_size=300, draft_vocab_size=128, target=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                                      num_attention_heads=2, num_key_value_heads=1,
                                                      max_position_embeddings=256),
    head_intermediate_size=64, seq_len=32, target_batch=4, draft_batch=4, max_steps=4, prompt_chars=300)


def build_demo_models(out: str | Path, workdir: str | Path, device: torch.device, minutes: float = 5.5,
                      shape: RecipeShape = RecipeShape(), files: list[Path] | None = None, progress: bool = True
                      ) -> dict:
    """Run the recipe; the pair lands in ``workdir/demo``, the packed parts and a report in ``out``."""
    out, demo_dir = Path(out), Path(workdir) / "demo"
    shutil.rmtree(demo_dir, ignore_errors=True)
    report: dict = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
                    "shape": asdict(shape), "minutes": minutes, "phases_s": {}}
    clock = _Clock(report["phases_s"])
    corpus = files if files is not None else _stdlib_corpus()
    train, heldout = split_heldout(corpus, HELDOUT_EVERY)
    tokenizer = train_bpe_tokenizer(read_documents(train), shape.vocab_size)
    stream = tokenize_documents(tokenizer, read_documents(train), tokenizer.eos_token_id)
    held = tokenize_documents(tokenizer, read_documents(heldout), tokenizer.eos_token_id) if heldout else None
    report.update(train_files=len(train), heldout_files=len(heldout), train_tokens=int(stream.numel()))
    clock.lap("corpus+tokenizer")
    target_dir = demo_dir / "target"
    report["target"] = _target_phase(shape, tokenizer, stream, held, target_dir, device, minutes, progress)
    _write_heldout(demo_dir / "heldout.json", corpus, heldout, shape.prompt_chars)
    clock.lap("target")
    data = tuple(str(f) for f in corpus)  # train_draft re-applies the same split: same held-out files
    for kind in ("eagle3", "mtp"):
        report[kind] = _draft_phase(kind, shape, target_dir, data, (stream, held), Path(workdir) / f"run-{kind}",
                                    demo_dir / kind, device, minutes, progress)
        clock.lap(kind)
    report["cpu_check"] = cpu_check(demo_dir, shape)
    clock.lap("cpu check")
    (demo_dir / "recipe.json").write_text(json.dumps(report, indent=2))
    report["sizes"] = check_sizes(demo_dir)
    report["packed"] = [str(p) for p in pack(demo_dir, out)]
    clock.lap("pack")
    (out / "build_report.json").write_text(json.dumps(report, indent=2))
    return report


def _stdlib_corpus(min_files: int = 200) -> list[Path]:
    files = stdlib_files()
    if len(files) < min_files:
        raise RuntimeError(f"only {len(files)} .py files under {stdlib_root()}: this Python's standard library "
                           f"sources are missing (the recipe needs at least {min_files})")
    return files


def _target_phase(shape: RecipeShape, tokenizer, stream: torch.Tensor, held: torch.Tensor | None, target_dir: Path,
                  device: torch.device, minutes: float, progress: bool) -> dict:
    config = llama_config(shape.vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id, **shape.target)
    loop = LoopConfig(max_steps=shape.max_steps, lr=shape.target_lr, warmup_steps=200, weight_decay=0.1,
                      time_budget_s=60 * minutes * PHASE_SHARE["target"])
    model, result = train_target(config, stream, loop, shape.target_batch, shape.seq_len, device,
                                 state_dir=None, progress=progress)
    summary = {"steps": result.step, "seconds": round(result.seconds, 1),
               "train_loss_last": round(sum(result.losses[-20:]) / len(result.losses[-20:]), 4)}
    if held is not None and held.numel() > shape.seq_len:
        summary["heldout_loss"] = round(eval_loss(model, held, shape.target_batch, shape.seq_len, device), 4)
    save_target(model, target_dir)
    save_tokenizer(tokenizer, target_dir, config.max_position_embeddings)
    print(f"target: {summary}", flush=True)
    return summary


def _draft_phase(kind: str, shape: RecipeShape, target_dir: Path, data: tuple[str, ...],
                 streams: tuple[torch.Tensor, torch.Tensor | None], run_dir: Path, dest: Path, device: torch.device,
                 minutes: float, progress: bool) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = DraftTrainConfig(
        target=str(target_dir), data=data, kind=kind, out=str(run_dir), steps=shape.max_steps,
        batch_size=shape.draft_batch, seq_len=shape.seq_len, lr=shape.eagle3_lr if kind == "eagle3" else shape.mtp_lr,
        ttt_steps=shape.ttt_steps, draft_vocab=shape.draft_vocab_size if kind == "eagle3" else None,
        intermediate_size=shape.head_intermediate_size if kind == "eagle3" else None, suffixes=(".py",),
        heldout_every=HELDOUT_EVERY, time_budget_s=60 * minutes * PHASE_SHARE[kind], save_every=0,
        device=str(device), progress=progress)
    summary = train_draft(cfg, streams).summary
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "model.safetensors.index.json", "model-mtp.safetensors"):
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, dest / name)
    result = {k: summary[k] for k in ("steps", "seconds", "last_step", "heldout")}
    print(f"{kind}: {result}", flush=True)
    return result


def cpu_check(demo_dir: Path, shape: RecipeShape, num_prompts: int = 8, k: int = 3) -> dict:
    """Greedy acceptance of both heads on held-out prompts, decoded on the CPU as a user would."""
    from ..acceptance_eval import acceptance, heldout_texts, load, prompt_ids
    from ..tokenizer import load_tokenizer

    prompt_tokens, new_tokens = min(64, shape.seq_len), min(64, shape.seq_len)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 4))  # a user's laptop, not a 100-core host; tiny ops gain nothing
    texts = heldout_texts(demo_dir / "heldout.json")
    prompts = prompt_ids(load_tokenizer(demo_dir / "target"), texts, num_prompts, prompt_tokens)
    result = {"num_prompts": len(prompts), "prompt_tokens": prompt_tokens, "max_new_tokens": new_tokens, "k": k}
    for name, spec in (("eagle3", Eagle3Config(speculative_model=str(demo_dir / "eagle3"), max_draft_len=k)),
                       ("mtp", MTPConfig(max_draft_len=k, mtp_checkpoint=str(demo_dir / "mtp")))):
        model = load(str(demo_dir / "target"), spec, "cpu", "float32", prompt_tokens + new_tokens + 16)
        result[name] = acceptance(model, prompts, new_tokens, temperature=0.0)
        print(f"cpu check {name}: mean accepted length {result[name]['mean_accepted_length']:.3f} "
              f"{result[name]['acceptance_rate_per_position']}", flush=True)
    torch.set_num_threads(threads)
    return result


def _write_heldout(path: Path, corpus: list[Path], heldout: list[Path], prompt_chars: int) -> None:
    root = _common_root(corpus)
    entries = [{"file": str(f.relative_to(root)),
                "text": f.read_text(encoding="utf-8", errors="replace")[:prompt_chars]} for f in heldout]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "rule": f"the {HELDOUT_EVERY}th, {2 * HELDOUT_EVERY}th, ... file of the sorted list of every .py file under "
                "the stdlib directory (site-packages excluded) is held out",
        "stdlib": str(root), "python": platform.python_version(), "num_files": len(corpus),
        "files": [e["file"] for e in entries], "prompts": entries}, indent=1))


def _common_root(files: list[Path]) -> Path:
    """The deepest directory holding every file (the stdlib directory for the default corpus)."""
    root = Path(os.path.commonpath([str(f) for f in files]))
    return root.parent if root.is_file() else root


def check_sizes(demo_dir: Path) -> dict[str, int]:
    """Bytes per shipped file; raises if the pair exceeds MAX_BYTES or a file MAX_FILE_BYTES."""
    sizes = {str(p.relative_to(demo_dir)): p.stat().st_size for p in sorted(demo_dir.rglob("*")) if p.is_file()}
    big = {name: size for name, size in sizes.items() if size > MAX_FILE_BYTES}
    if big or sum(sizes.values()) > MAX_BYTES:
        raise ValueError(f"demo pair too large: {sum(sizes.values())} bytes (limit {MAX_BYTES}), files over "
                         f"{MAX_FILE_BYTES}: {big}")
    sizes["total"] = sum(sizes.values())
    return sizes


def pack(demo_dir: Path, out: Path, part_bytes: int = 14_000_000) -> list[Path]:
    """``demo/`` as a gzipped tar split into ``PACK_NAME.000``, ``.001``, ... parts of at most ``part_bytes``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(demo_dir, arcname="demo")
    data = buffer.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(PACK_NAME + ".*"):
        stale.unlink()
    parts = []
    for i, start in enumerate(range(0, len(data), part_bytes)):
        parts.append(out / f"{PACK_NAME}.{i:03d}")
        parts[-1].write_bytes(data[start:start + part_bytes])
    return parts


def unpack_command(out: str | Path) -> str:
    return (f"rm -rf tllm_spec/assets/demo && mkdir -p tllm_spec/assets && "
            f"cat {out}/{PACK_NAME}.* | tar xzf - -C tllm_spec/assets")


class _Clock:
    """Wall time of each phase, printed and recorded."""

    def __init__(self, record: dict[str, float]):
        self.record, self.last = record, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.record[phase] = round(now - self.last, 1)
        self.last = now
        print(f"[{phase}] {self.record[phase]:.1f} s", flush=True)
