"""Corpus files, the held-out split by file, jsonl documents, the token stream and its batches."""
import json

import pytest
import torch

from tllm_spec.training.data import (
    eval_windows,
    expand_paths,
    read_documents,
    sample_windows,
    split_heldout,
    tokenize_documents,
)


def test_every_tenth_file_is_held_out(tmp_path):
    files = [tmp_path / f"f{i:02d}.py" for i in range(25)]
    train, heldout = split_heldout(files)
    assert heldout == [files[9], files[19]]
    assert len(train) == 23 and not set(train) & set(heldout)
    assert split_heldout(files, 0) == (files, [])


def test_expand_paths_recurses_filters_and_sorts(tmp_path):
    for name in ["b/x.py", "a.py", "b/notes.md", "b/__pycache__/c.py", "site-packages/d.py", "e.bin", ".git/f.py"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert [p.relative_to(tmp_path).as_posix() for p in expand_paths([tmp_path])] == ["a.py", "b/notes.md", "b/x.py"]
    assert expand_paths([tmp_path], (".md",)) == [tmp_path / "b/notes.md"]
    with pytest.raises(FileNotFoundError, match="nothing"):
        expand_paths([tmp_path / "nothing"])


def test_jsonl_documents_and_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 3}) + "\n")
    assert list(read_documents([good])) == ["one", "two"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"content": "no"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        list(read_documents([bad]))


class CharTokenizer:
    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def test_stream_appends_eos_and_windows_are_deterministic():
    stream = tokenize_documents(CharTokenizer(), ["ab", "c"], eos_token_id=0, chunk=1)
    assert stream.tolist() == [97, 98, 0, 99, 0]
    long = torch.arange(1000, dtype=torch.int32)
    a, b = sample_windows(long, 4, 16, seed=1, step=5), sample_windows(long, 4, 16, seed=1, step=5)
    assert torch.equal(a, b) and a.dtype == torch.int64 and a.shape == (4, 16)
    assert not torch.equal(a, sample_windows(long, 4, 16, seed=1, step=6))
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 15, dtype=torch.int64))  # contiguous windows
    batches = eval_windows(long, 4, 100, max_batches=2)
    assert [b.shape[0] for b in batches] == [4, 4]
    starts = torch.cat(batches)[:, 0]
    assert starts[0] == 0 and starts[-1] == 900 and bool((starts[1:] - starts[:-1] >= 100).all())  # spread, disjoint
