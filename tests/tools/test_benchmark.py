"""The roofline byte count of a generation step and the draft-length sweep's arithmetic (the benchmark
itself runs on a GPU)."""
import pytest

from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.benchmark import Point, best_schedule, expected_accepted_drafts, step_bytes

from ..models import eagle3, tiny_pair


def test_step_bytes_counts_weights_once_draft_per_pass_and_kv():
    target, head = tiny_pair("llama")
    spec = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2)
    plain = SpecModel.from_pretrained(target, None, max_batch_size=2)
    cfg = plain.target.config  # 8 layers, hidden 64, 2 KV heads x 16, vocab 97, untied, fp32
    target_weights = sum(p.numel() for p in plain.target.hf.parameters()) - 97 * 64
    kv_per_token = cfg.num_hidden_layers * 2 * 2 * 16
    assert step_bytes(plain, batch=2, context_len=10) == 4 * (target_weights + 2 * 10 * kv_per_token)
    draft = spec.worker.draft_model
    fc = draft.fc.weight.numel()
    per_pass = sum(p.numel() for n, p in draft.named_parameters() if not n.startswith(("fc.", "embed_tokens.")))
    expected = target_weights + 2 * 10 * kv_per_token + fc + 3 * per_pass + 3 * 2 * 10 * (2 * 2 * 16)
    assert step_bytes(spec, batch=2, context_len=10) == 4 * expected

    assert step_bytes(spec, batch=2, context_len=10, draft_len=1) == 4 * (expected - 2 * per_pass
                                                                          - 2 * 2 * 10 * (2 * 2 * 16))
    layer = sum(p.numel() for p in draft.midlayer.parameters())
    assert step_bytes(spec, batch=2, context_len=10, draft_len=0) == 4 * (expected - 3 * per_pass + layer
                                                                          - 2 * 2 * 10 * (2 * 2 * 16))


def test_step_bytes_of_a_tree_step_count_a_head_pass_per_depth():
    """A tree of 5 drafts, 2 deep, reads what a chain of its depth reads (the tree's rows share one read of the
    weights and of the context's K/V); a schedule's chain step of 1 draft reads a chain's."""
    target, head = tiny_pair("llama")
    chain = SpecModel.from_pretrained(target, eagle3(head, 2), max_batch_size=2)
    tree = SpecModel.from_pretrained(target, eagle3(head, 2).model_copy(update={
        "eagle_choices": [[0], [1], [2], [0, 0], [1, 0]]}), max_batch_size=2)
    assert tree.max_draft_len == 5
    assert step_bytes(tree, batch=2, context_len=10) == step_bytes(chain, batch=2, context_len=10)
    assert step_bytes(tree, batch=2, context_len=10, draft_len=1) == step_bytes(chain, batch=2, context_len=10,
                                                                                draft_len=1)


def test_expected_accepted_drafts_of_a_chain():
    assert expected_accepted_drafts(0, 0.7) == 0
    assert expected_accepted_drafts(3, 0.7) == pytest.approx(0.7 + 0.49 + 0.343)
    assert expected_accepted_drafts(3, 1.0) == 3


def point(batch, draft_len, tps):
    return Point("eagle3", batch, draft_len, None, 1.0, 0.0, 1.0, tps, 1.0, 1.0, 1.0, 0.0)


def test_best_schedule_keeps_the_fastest_length_per_batch_and_merges_repeats():
    points = [point(1, 0, 100), point(1, 3, 300), point(4, 3, 900), point(4, 2, 800),
              point(16, 2, 2000), point(16, 3, 1900), point(64, 2, 5000), point(64, 0, 6000)]
    assert best_schedule(points) == {1: 3, 16: 2, 64: 0}
