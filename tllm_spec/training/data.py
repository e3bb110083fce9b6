"""Training data: local text / jsonl files -> one token stream, a train / held-out split by file, batches.

Documents are whole files (``.jsonl``: one document per line, its ``"text"`` field), each followed by the
EOS token. Batches are random windows of the stream drawn from a generator seeded by (seed, step), so a
resumed run draws exactly the batches the interrupted one would have.
"""
from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".jsonl")
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
HELDOUT_EVERY = 10  # the default split: the 10th, 20th, ... file of the sorted list is held out


def expand_paths(paths: Sequence[str | Path], suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[Path]:
    """Files named directly, plus every file under the named directories whose suffix is in ``suffixes``
    (site-packages, __pycache__ and hidden directories skipped). Sorted by path; duplicates removed."""
    files: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            files.add(path)
        elif path.is_dir():
            files.update(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes
                         and not _skipped(p.relative_to(path)))
        else:
            raise FileNotFoundError(f"{path}: no such file or directory (--data takes files and directories)")
    if not files:
        raise ValueError(f"no {'/'.join(suffixes)} files found under {[str(p) for p in paths]}")
    return sorted(files)


def _skipped(relative: Path) -> bool:
    return any(part in _SKIPPED_DIRS or part.startswith(".") for part in relative.parts[:-1])


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """Every .py file of this Python's standard library (site-packages excluded), sorted by path."""
    return expand_paths([stdlib_root()], suffixes=(".py",))


def split_heldout(files: Sequence[Path], every: int = HELDOUT_EVERY, position: int | None = None
                  ) -> tuple[list[Path], list[Path]]:
    """(train, held-out): the files at 1-based positions p, p + every, p + 2*every, ... of ``files`` are held
    out, p = ``position`` (default ``every``: the 10th, 20th, ... file); ``every = 0``: nothing held out."""
    if every <= 0:
        return list(files), []
    p = (every if position is None else position) % every
    heldout = [f for i, f in enumerate(files) if (i + 1) % every == p]
    train = [f for i, f in enumerate(files) if (i + 1) % every != p]
    if not train:
        raise ValueError(f"{len(files)} file(s): nothing left to train on after holding out every {every}th")
    return train, heldout


def read_documents(files: Iterable[Path]) -> Iterator[str]:
    """Each file's text (undecodable bytes replaced); ``.jsonl`` files yield each line's ``"text"``."""
    for path in files:
        if path.suffix != ".jsonl":
            yield path.read_text(encoding="utf-8", errors="replace")
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{number}: a jsonl line must be an object with a string 'text' field")
            yield record["text"]


def tokenize_documents(tokenizer, documents: Iterable[str], eos_token_id: int, chunk: int = 256) -> torch.Tensor:
    """One stream [N] int32: every document's tokens followed by ``eos_token_id``."""
    pieces: list[torch.Tensor] = []
    batch: list[str] = []
    for doc in documents:
        batch.append(doc)
        if len(batch) == chunk:
            pieces += _encode(tokenizer, batch, eos_token_id)
            batch = []
    pieces += _encode(tokenizer, batch, eos_token_id)
    if not pieces:
        raise ValueError("no documents to tokenize")
    return torch.cat(pieces)


def _encode(tokenizer, texts: list[str], eos_token_id: int) -> list[torch.Tensor]:
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)  # fast path, and no max-length warnings
    if backend is not None:
        ids = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    else:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [torch.tensor(list(doc) + [eos_token_id], dtype=torch.int32) for doc in ids]


def sample_windows(stream: torch.Tensor, batch_size: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
    """[batch_size, seq_len] int64 random windows of ``stream`` [N], determined by (seed, step)."""
    if stream.numel() <= seq_len:
        raise ValueError(f"the token stream has {stream.numel()} tokens; seq_len {seq_len} needs more")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - seq_len, (batch_size,), generator=g)
    return torch.stack([stream[s:s + seq_len] for s in starts.tolist()]).long()


def sample_rows(rows: torch.Tensor, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """[batch_size, S] int64: random rows of ``rows`` [N, S], determined by (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step + 500_000_009)  # not sample_windows' draws
    return rows[torch.randint(0, rows.shape[0], (batch_size,), generator=g)].long()


def eval_windows(stream: torch.Tensor, batch_size: int, seq_len: int, max_batches: int) -> list[torch.Tensor]:
    """Up to ``max_batches`` batches [b, seq_len] int64 of non-overlapping windows spread evenly over ``stream``
    (evaluation: every part of a validation set counts, not just its first files)."""
    num = min(stream.numel() // seq_len, batch_size * max_batches)
    if num == 0:
        return []
    starts = torch.linspace(0, stream.numel() - seq_len, num).long()
    windows = torch.stack([stream[s:s + seq_len] for s in starts.tolist()]).long()
    return list(windows.split(batch_size))
