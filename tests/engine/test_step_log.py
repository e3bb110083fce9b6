"""StepLog: the engine's steps as launched and read, and the summary a serving run's analysis starts from."""
import torch

from tllm_spec import SamplingParams, SpecModel
from tllm_spec.engine.step_log import StepLog, StepRecord

from ..models import eagle3, tiny_pair


def test_the_summary_splits_the_span_into_prefill_steps_and_idle_gaps():
    log = StepLog()
    log.record(StepRecord(0.0, 0.001, 0.030, 64, 2, 2, False, 1))  # a prefill step, 30 ms
    log.record(StepRecord(0.032, 0.033, 0.040, 0, 0, 2, False, 1))  # 2 ms with nothing in flight before it
    log.record(StepRecord(0.035, 0.036, 0.050, 0, 0, 2, True, 0))  # launched ahead: no gap
    summary = log.summary()
    assert summary["steps"] == 3 and summary["prefill_steps"] == 1
    assert summary["prompt_tokens_per_prefill_step"] == 64 and summary["prompt_requests_per_prefill_step"] == 2
    assert summary["span_s"] == 0.05 and summary["prefill_steps_s"] == 0.03
    assert summary["idle_between_steps_s"] == 0.002
    assert StepLog().summary() == {"steps": 0}


def test_the_engine_records_each_step_when_a_log_is_set():
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, eagle3(head, 3), dtype=torch.float32, max_batch_size=2)
    log = StepLog()
    model.engine.step_log = log
    outs = model.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    records = list(log.records)
    assert sum(r.prompt_tokens for r in records) == 9 and sum(r.prompt_requests for r in records) == 3
    assert records[0].waiting == 1  # two slots: the third request waited
    assert sum(r.rows for r in records) >= sum(len(o.token_ids) for o in outs) / 4  # at most K + 1 tokens a row
    assert all(r.start <= r.launched <= r.done for r in records)
