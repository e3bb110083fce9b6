"""A draft that proposes the target's own continuation is accepted K of K; forcing changes counts only."""
import pytest
import torch

from tllm_spec import SamplingParams
from tllm_spec.drafts.eagle3.worker import Eagle3OneModelWorker
from tllm_spec.sampling.forcing import ENV_VAR
from tllm_spec.spec_model import SpecModel

from ..models import eagle3, hf_greedy, tiny_pair

PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5]]
MAX_NEW = [15, 11, 13]


class OracleWorker(Eagle3OneModelWorker):
    """Test double: proposes the recorded target continuation of the request in each KV slot."""

    def __init__(self, k, draft_model, sequences):
        super().__init__(k, draft_model, use_flashinfer=False)
        self.sequences = sequences  # slot -> prompt + reference continuation

    def draft(self, input_ids, target_tokens, target_features, num_accepted, attn, spec_metadata, paths=None):
        last = spec_metadata.gather_ids[spec_metadata.first_rows() + num_accepted - 1]
        rows = []
        for slot, pos in zip(attn.token_slots[last].tolist(), attn.positions[last].tolist()):
            seq = self.sequences[slot]  # token at position pos+1 is the last accepted; drafts follow it
            rows.append(seq[pos + 2:pos + 2 + spec_metadata.next_draft_len])
        return torch.tensor(rows, dtype=torch.int64).view(len(rows), spec_metadata.next_draft_len)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_drafts_accepted_every_step(monkeypatch, k):
    monkeypatch.delenv(ENV_VAR, raising=False)
    target, head = tiny_pair("llama")
    refs = [hf_greedy(target, p, n + 2 * k + 2) for p, n in zip(PROMPTS, MAX_NEW)]
    model = SpecModel.from_pretrained(target, eagle3(head, k), max_batch_size=3)
    sequences = {i: p + r for i, (p, r) in enumerate(zip(PROMPTS, refs))}
    model.runner.model.worker = OracleWorker(k, model.worker.draft_model, sequences)
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    for out, ref, n in zip(outs, refs, MAX_NEW):
        assert out.token_ids == ref[:n]
        assert out.stats.num_steps == -(-(n - 1) // (k + 1))  # 1 context token, then K+1 per step
        assert out.stats.histogram == [0] * k + [out.stats.num_steps]
        assert out.stats.acceptance_rate_per_position == [1.0] * k


@pytest.mark.parametrize("value,allowed", [("1", {2}), ("3", {4}), ("9", {4}), ("0", {1}), ("1.5", {2, 3})])
def test_forced_acceptance_sets_counts(monkeypatch, value, allowed):
    monkeypatch.setenv(ENV_VAR, value)
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=3)
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    per_step = [n for out in outs for n in out.stats.accepted_per_step]
    assert set(per_step) == allowed
    assert [len(o.token_ids) for o in outs] == MAX_NEW


def test_fractional_forcing_draws_anew_every_step_of_a_greedy_request(monkeypatch):
    # one greedy request samples nothing else: the lottery alone must move the stream between steps
    monkeypatch.setenv(ENV_VAR, "1.5")
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=1)
    per_step = model.generate([PROMPTS[0]], SamplingParams(max_new_tokens=120))[0].stats.accepted_per_step
    assert set(per_step) == {2, 3}
    assert 0.25 < per_step.count(3) / len(per_step) < 0.75  # ~48 Bernoulli(0.5) draws


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_tree_whose_second_branch_is_right_accepts_it_every_step(monkeypatch, arch):
    """A static tree whose most likely branch is always wrong and whose second branch ([1], [1, 0], [1, 0, 0]) holds
    the target's own continuation: every step accepts 3 drafts along rows 2, 4, 6 of the tree, not its first
    rows, so the tree masks, the per-depth RoPE positions and the moving of the path's K/V decide every token;
    the output equals HF's greedy decode (Llama, and Qwen3 with its q/k norms)."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    target, head = tiny_pair(arch)
    choices = [[0], [1], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0]]  # nodes 1..6 in this order
    refs = [hf_greedy(target, p, n + 8) for p, n in zip(PROMPTS, MAX_NEW)]
    model = SpecModel.from_pretrained(target, eagle3(head, 3).model_copy(update={"eagle_choices": choices}),
                                      max_batch_size=3)
    sequences = {i: p + r for i, (p, r) in enumerate(zip(PROMPTS, refs))}
    vocab = model.target.vocab_size

    def oracle(draft_model, hidden, position, slots, attn, spec_metadata=None, draft_probs=None, guided=None):
        rows = []
        for slot, pos in zip(slots.tolist(), position.tolist()):
            right = sequences[slot][pos + 2:pos + 5]  # the root is token pos + 1; depths 1..3 follow it
            wrong = [(t + 1) % vocab for t in right]
            rows.append([wrong[0], right[0], wrong[1], right[1], wrong[2], right[2]])
        return torch.tensor(rows, dtype=torch.int64)
    monkeypatch.setattr(model.worker.tree_step, "draft", oracle)
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    for out, ref, n in zip(outs, refs, MAX_NEW):
        assert out.token_ids == ref[:n]
        assert out.stats.accepted_per_step[:-1] == [4] * (out.stats.num_steps - 1)  # the last: cut by max tokens
