"""Draft length by batch size (``draft_len_schedule``): the lookup, the config rules, and lossless decoding while
the draft length changes from step to step (down to 0 drafts and back) for EAGLE-3 and MTP-Eagle, greedy and
at T > 0."""
import itertools

import pytest
from pydantic import ValidationError

from tllm_spec import Eagle3Config, MTPConfig, SamplingParams
from tllm_spec.spec_model import SpecModel

from ..drafts.test_full_acceptance import OracleWorker
from ..models import eagle3, hf_greedy, tiny_pair
from ..sampling.test_distribution import exact_joint, pvalue, sample_pairs
from ..test_mtp_lossless import mtp_target

PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6, 7, 8, 9], [33, 34, 35, 36],
           [90, 1, 90, 1, 90]]
MAX_NEW = [14, 9, 17, 5, 12]  # requests finish at different steps; the 5th waits for a slot
SCHEDULE = {1: 3, 2: 2, 3: 1, 4: 0}  # every batch size 1..4 of a 4-slot engine drafts a different number


def schedule_config(head, schedule=SCHEDULE):
    return eagle3(head, 3).model_copy(update={"draft_len_schedule": schedule})


def record_steps(model):
    """Wrap model.runner.step to record (draft_len, next_draft_len) of every step; returns the list."""
    seen, step = [], model.runner.step

    def recording(*args):
        seen.append(args[6:8])  # (ids, positions, slots, drafts, params, context_lens, draft_len, next_draft_len, ...)
        return step(*args)
    model.runner.step = recording
    return seen


def test_lookup_takes_the_largest_key_not_above_the_batch():
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, schedule_config(head, {1: 3, 4: 2, 8: 0}))
    assert [model.runner.draft_len_for(b) for b in range(1, 11)] == [3, 3, 3, 2, 2, 2, 2, 0, 0, 0]
    model.runner.set_draft_len_schedule(None)
    assert {model.runner.draft_len_for(b) for b in range(1, 11)} == {3}
    with pytest.raises(ValueError, match="batch size 1"):
        model.runner.set_draft_len_schedule({2: 2})
    model.runner.set_draft_len_schedule({1: 1})
    assert model.runner.draft_len_for(5) == 1


@pytest.mark.parametrize("schedule,message", [({2: 3}, "batch size 1"), ({1: 3, 0: 1}, ">= 1"),
                                              ({1: 3, 8: 4}, "0..3"), ({1: -1}, "0..3")])
def test_config_rules(schedule, message):
    with pytest.raises(ValidationError, match=message):
        Eagle3Config(speculative_model="x", max_draft_len=3, draft_len_schedule=schedule)


def test_vanilla_mtp_refuses_a_schedule():
    with pytest.raises(ValidationError, match="vanilla MTP"):
        MTPConfig(num_nextn_predict_layers=2, use_mtp_vanilla=True, draft_len_schedule={1: 2})
    model = SpecModel.from_pretrained(mtp_target("llama", "deepseek"),
                                      MTPConfig(num_nextn_predict_layers=2, use_mtp_vanilla=True))
    with pytest.raises(ValueError, match="vanilla MTP"):
        model.runner.set_draft_len_schedule({1: 2, 4: 1})


def test_oracle_drafts_stay_accepted_while_the_draft_length_changes():
    # four requests in four slots (slot = request index, as the oracle needs): the batch shrinks 4 -> 1 as they
    # finish, so the steps draft 0, 1, 2, then 3 tokens
    target, head = tiny_pair("llama")
    prompts, max_new = PROMPTS[:4], MAX_NEW[:4]
    refs = [hf_greedy(target, p, n + 8) for p, n in zip(prompts, max_new)]
    model = SpecModel.from_pretrained(target, schedule_config(head), max_batch_size=4)
    sequences = {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}
    model.runner.model.worker = OracleWorker(3, model.worker.draft_model, sequences)
    steps = record_steps(model)
    outs = model.generate(prompts, [SamplingParams(max_new_tokens=n) for n in max_new])
    assert [o.token_ids for o in outs] == [r[:n] for r, n in zip(refs, max_new)]
    assert {k for k, _ in steps} == {0, 1, 2, 3} and any(k != next_k for k, next_k in steps)
    per_step = [n for o in outs for n in o.stats.accepted_per_step]
    assert per_step and min(per_step) >= 2  # every counted step verified >= 1 oracle draft and accepted it


def test_steps_without_drafts_are_not_counted():
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, schedule_config(head, {1: 3, 2: 0}), max_batch_size=2)
    outs = model.generate(PROMPTS[:2], [SamplingParams(max_new_tokens=n) for n in (4, 12)])
    assert outs[0].stats.num_steps == 0  # its whole life was in batches of 2: no drafts verified
    assert outs[1].stats.num_steps > 0  # alone afterwards, with 3 drafts


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_eagle3_greedy_lossless_under_a_schedule(arch):
    target, head = tiny_pair(arch)
    model = SpecModel.from_pretrained(target, schedule_config(head), max_batch_size=4)
    steps = record_steps(model)
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    for prompt, n, out in zip(PROMPTS, MAX_NEW, outs):
        assert out.token_ids == hf_greedy(target, prompt, n), f"prompt {prompt}"
    assert {k for k, _ in steps} == {0, 1, 2, 3}


@pytest.mark.parametrize("modules,selection", [(1, "first"), (3, "per_step")])
def test_mtp_eagle_greedy_lossless_under_a_schedule(modules, selection):
    target = mtp_target("llama", "deepseek")
    config = MTPConfig(num_nextn_predict_layers=modules, max_draft_len=3, mtp_layer_selection=selection,
                       draft_len_schedule=SCHEDULE)
    model = SpecModel.from_pretrained(target, config, max_batch_size=4)
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    for prompt, n, out in zip(PROMPTS, MAX_NEW, outs):
        assert out.token_ids == hf_greedy(target, prompt, n), f"prompt {prompt}"


def test_rejection_sampling_distribution_while_the_draft_length_cycles(monkeypatch):
    target, head = tiny_pair("llama", vocab_size=8, seed=4)
    config = eagle3(head, 3).model_copy(update={"use_rejection_sampling": True})
    model = SpecModel.from_pretrained(target, config, max_batch_size=64)
    lengths = itertools.cycle([3, 1, 0, 2])  # every step proposes a different number of drafts than it verifies
    monkeypatch.setattr(model.runner, "draft_len_for", lambda batch_size: next(lengths))
    counts, stats = sample_pairs(model, 1.0, seed=7)
    assert pvalue(counts, exact_joint(target, 1.0)) > 1e-3
    assert stats["acceptance_rate_per_position"][0] > 0.05  # drafts were accepted: the accept path ran
    assert pvalue(counts, exact_joint(target, 0.6)) < 1e-4  # the check has power


def test_acceptance_rates_count_only_steps_that_drafted_the_position():
    from tllm_spec.engine.request import AcceptanceStats
    stats = AcceptanceStats(3)
    stats.record(4, 3)  # 3 of 3 drafts accepted
    stats.record(2, 1)  # 1 of 1: positions 2 and 3 were not drafted
    stats.record(1, 3)  # none of 3
    assert stats.acceptance_rate_per_position == [2 / 3, 1 / 2, 1 / 2]
    assert stats.histogram == [1, 1, 0, 1] and stats.mean_accepted_length == 7 / 3
