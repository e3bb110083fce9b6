"""compare(): the speculative run, then plain decoding of the same prompts on the same settings; the summary."""
import pytest

from tllm_spec import Eagle3Config, MTPConfig, RunConfig, SamplingParams
from tllm_spec.tools.comparison import compare
from tllm_spec.tools.report import describe, format_comparison

from ..models import tiny_pair

PROMPTS = [[5, 17, 3, 44], [12, 8, 40]]


def run_config(temperature: float = 0.0) -> RunConfig:
    target, head = tiny_pair()
    return RunConfig(target_model=str(target), spec_config=Eagle3Config(speculative_model=str(head), max_draft_len=2),
                     sampling=SamplingParams(max_new_tokens=6, temperature=temperature), device="cpu",
                     dtype="float32")


def test_greedy_comparison_has_identical_outputs_and_both_speeds():
    cfg = run_config()
    result = compare(cfg, PROMPTS)
    assert result.same_tokens and [len(o.token_ids) for o in result.plain] == [6, 6]
    assert result.plain.stats["mean_accepted_length"] == 1.0 and result.spec.stats["steps"] > 0
    assert result.speedup == pytest.approx(result.spec.stats["tokens_per_second"]
                                           / result.plain.stats["tokens_per_second"])
    text = format_comparison(result, cfg)
    assert "speedup" in text and "EAGLE-3, K=2" in text and "identical outputs: yes" in text


def test_comparison_needs_a_speculative_config():
    with pytest.raises(ValueError, match="speculative"):
        compare(run_config().model_copy(update={"spec_config": None}), PROMPTS)


def test_describe_names_the_method():
    assert describe(None) == "plain"
    assert describe(MTPConfig(max_draft_len=3)) == "MTP-Eagle, K=3"
    assert describe(MTPConfig(num_nextn_predict_layers=2, use_mtp_vanilla=True)) == "MTP (2 modules)"
