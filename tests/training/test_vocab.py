"""Draft vocabulary from token frequencies: the most frequent ids, d2t offsets, t2d, and the checkpoint round trip."""
import torch
from safetensors.torch import load_file

from tllm_spec.drafts.eagle3.checkpoint import Eagle3Checkpoint, load_eagle3_checkpoint, save_eagle3_checkpoint
from tllm_spec.tools.random_models import random_eagle3_checkpoint
from tllm_spec.training.vocab import build_draft_vocab, draft_to_target, target_to_draft, token_counts


def test_most_frequent_ids_sorted_with_ties_to_the_lower_id():
    stream = torch.tensor([7, 7, 7, 2, 2, 9, 9, 5, 1, 1, 1, 1])
    counts = token_counts(stream, 10)  # 1:4, 7:3, 2:2, 9:2, 5:1
    vocab = build_draft_vocab(counts, 4)
    assert vocab.draft_ids.tolist() == [1, 2, 7, 9]  # 2 and 9 tie with 2 each; 5 is left out
    assert vocab.d2t.tolist() == [1, 1, 5, 6]  # target id = i + d2t[i]
    assert vocab.t2d.nonzero().flatten().tolist() == [1, 2, 7, 9]


def test_forced_ids_are_included():
    counts = token_counts(torch.tensor([3, 3, 4, 4, 5]), 8)
    vocab = build_draft_vocab(counts, 2, always=[0])
    assert vocab.draft_ids.tolist() == [0, 3]


def test_full_size_is_the_identity():
    vocab = build_draft_vocab(torch.ones(6, dtype=torch.int64), 6)
    assert vocab.d2t.tolist() == [0] * 6 and bool(vocab.t2d.all())


def test_d2t_t2d_round_trip():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 1000, (97,), generator=g)
    vocab = build_draft_vocab(counts, 40)
    ids = draft_to_target(vocab.d2t)
    assert torch.equal(target_to_draft(vocab.t2d)[ids], torch.arange(40))
    assert int((target_to_draft(vocab.t2d) >= 0).sum()) == 40
    assert counts[ids].min() >= counts[~vocab.t2d].max()  # every kept id is at least as frequent as any dropped


def test_written_checkpoint_keeps_d2t_and_t2d(tmp_path):
    counts = torch.arange(97)
    vocab = build_draft_vocab(counts, 40)
    ckpt = random_eagle3_checkpoint(32, 2, 1, 16, 64, 97, 40)
    state = {**ckpt.state_dict, "d2t": vocab.d2t}
    save_eagle3_checkpoint(tmp_path, Eagle3Checkpoint(ckpt.config, state), "eagle")
    assert torch.equal(load_eagle3_checkpoint(tmp_path).state_dict["d2t"], vocab.d2t)
    assert torch.equal(load_file(str(tmp_path / "model.safetensors"))["t2d"], vocab.t2d)
