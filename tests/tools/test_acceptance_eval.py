"""Acceptance evaluation on the tiny trained pair: the methods evaluated, statistics per head and temperature, speed,
table, CLI."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tllm_spec.config import DraftTargetConfig, Eagle3Config, MTPConfig, SAConfig
from tllm_spec.model.quant.linear import Fp8Linear
from tllm_spec.tokenizer import load_tokenizer
from tllm_spec.tools import acceptance_eval
from tllm_spec.tools.acceptance_eval import (
    evaluate,
    format_table,
    head_configs,
    prompt_ids,
    ratio_standard_error,
)

from ..models import tiny_pair
from ..training.helpers import corpus, tiny_target, trained

SCRIPT = Path(__file__).parents[2] / "scripts" / "eval_acceptance.py"


def heldout_json(path: Path) -> Path:
    texts = [f.read_text()[:400] for f in sorted(corpus().glob("*.py"))[:3]] + ["short"]
    path.write_text(json.dumps({"prompts": [{"file": str(i), "text": t} for i, t in enumerate(texts)]}))
    return path


def test_prompts_are_the_first_tokens_of_long_enough_texts():
    tokenizer = load_tokenizer(tiny_target())
    prompts = prompt_ids(tokenizer, ["short", "def f(x):\n    return x + 1\n" * 4], 2, 12)
    assert len(prompts) == 1 and len(prompts[0]) == 12
    assert tokenizer.decode(prompts[0]).startswith("def f(x):")
    with pytest.raises(ValueError, match="12 tokens"):
        prompt_ids(tokenizer, ["short"], 2, 12)


def test_standard_error_of_the_mean_accepted_length():
    # two prompts of 2 steps: 6 and 2 tokens; ratio 2, residuals 2 and -2: sqrt(2 * 8) / 4 = 1
    assert ratio_standard_error([(6, 2), (2, 2)]) == 1.0
    assert ratio_standard_error([(6, 2), (6, 2), (6, 2)]) == 0.0  # every prompt alike
    assert ratio_standard_error([(6, 2)]) == 0.0
    # unequal lengths: the delta method's value, against 20000 bootstrap resamples of the prompts
    per_prompt = [(9, 3), (4, 4), (30, 10), (7, 2), (12, 6), (5, 5)]
    g = torch.Generator().manual_seed(0)
    pairs = torch.tensor(per_prompt, dtype=torch.float64)[torch.randint(0, 6, (20000, 6), generator=g)]
    boot = pairs[..., 0].sum(1) / pairs[..., 1].sum(1)
    assert abs(ratio_standard_error(per_prompt) - boot.std().item()) < 0.15 * boot.std().item()


def test_every_method_is_named_with_its_config():
    heads = head_configs("e3", "target", 3, draft="d", sa_k=8, sa_spec_threshold=5)
    assert list(heads) == ["eagle3", "mtp", "draft_target", "sa", "eagle3+sa", "mtp+sa"]
    assert heads["draft_target"] == DraftTargetConfig(speculative_model="d", max_draft_len=3,
                                                      use_rejection_sampling=True)
    assert heads["sa"] == SAConfig(max_draft_len=8)
    assert heads["eagle3+sa"] == Eagle3Config(speculative_model="e3", max_draft_len=3, use_rejection_sampling=True,
                                              use_sa_spec=True, sa_spec_threshold=5)
    assert heads["mtp+sa"] == MTPConfig(max_draft_len=3, use_rejection_sampling=True, use_sa_spec=True,
                                        sa_spec_threshold=5)
    assert list(head_configs("e3", None, 3)) == ["eagle3"]  # the new methods only when asked
    assert list(head_configs(None, None, 3, sa_k=4, sa_spec_threshold=4)) == ["sa"]


def test_evaluate_on_an_fp8_target_loads_every_model_quantized(monkeypatch):
    loaded, load = [], acceptance_eval.load

    def recording(*args):
        model = load(*args)
        loaded.append(isinstance(model.target.hf.model.layers[0].mlp.down_proj, Fp8Linear))
        return model
    monkeypatch.setattr(acceptance_eval, "load", recording)
    prompts = [[5, 17, 3, 44, 9, 2, 5, 17, 3], [12, 8, 40, 41, 12, 8, 40]]
    result = evaluate(str(tiny_pair("llama")[0]), {"sa": SAConfig(max_draft_len=4)}, prompts, max_new_tokens=8,
                      temperatures=(0.0,), speed_prompts=0, progress=False, quantization="fp8")
    assert loaded == [True, True] and result["quantization"] == "fp8"
    assert result["heads"]["sa"]["T=0"]["num_tokens"] == 16


@pytest.mark.slow  # ten seconds or more on the 2-core CI machine
def test_evaluate_reports_every_head_and_temperature():
    heads = head_configs(str(trained("eagle3").out), str(trained("mtp").out), k=3)
    prompts = [[5, 17, 3, 44, 9, 2, 71], [12, 8, 40, 41, 42, 3, 4]]
    result = evaluate(str(tiny_target()), heads, prompts, max_new_tokens=10, speed_prompts=1, repeats=1,
                      progress=False)
    for name in ("eagle3", "mtp"):
        for key in ("T=0", "T=1"):
            stats = result["heads"][name][key]
            assert stats["num_tokens"] == 20 and sum(stats["histogram"]) == stats["steps"]
            assert 1.0 <= stats["mean_accepted_length"] <= 4.0 and len(stats["acceptance_rate_per_position"]) == 3
            assert stats["mean_accepted_length_se"] >= 0
        assert result["heads"][name]["T=0"]["prompts_matching_plain"] == 2  # greedy speculation is lossless
        assert result["speed"][name]["speedup"] > 0
    assert result["speed"]["plain"]["tokens_per_s"] > 0
    table = format_table(result)
    assert table.count("\n") == 6 and "| eagle3 | 0 |" in table and "| mtp | 1 |" in table
    assert table.split("\n")[3].endswith("| 2/2 |") and table.split("\n")[4].endswith("| - |")


@pytest.mark.slow  # the evaluation CLI end to end: six seconds here, kept out of the README command for its margin
def test_cli_writes_json_table_and_plot(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("eval_acceptance", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "eval"
    monkeypatch.setattr(sys, "argv", [
        "eval_acceptance.py", "--target", str(tiny_target()), "--eagle3", str(trained("eagle3").out), "--mtp", "none",
        "--draft-model", str(tiny_target()), "--sa-k", "4", "--sa-spec-threshold", "2", "--edit-max-chars", "400",
        "--prompts-from", str(heldout_json(tmp_path / "heldout.json")), "--num-prompts", "2", "--prompt-tokens", "16",
        "--max-new-tokens", "6", "--speed-prompts", "1", "--repeats", "1", "--temperatures", "0", "--out", str(out),
        "--quantization", "fp8"])
    script.main()
    result = json.loads((out / "acceptance.json").read_text())
    assert result["num_prompts"] == 2 and result["prompt_tokens"] == 16  # the first-line workload's, as before
    assert result["quantization"] == "fp8"
    assert list(result["heads"]) == ["eagle3", "draft_target", "sa", "eagle3+sa"]
    agreement = result.pop("top1_agreement")  # the FP8 target against the 16-bit one, teacher-forced
    assert agreement["quantization"] == "fp8" and agreement["positions"] > 0 and 0.5 < agreement["agreement"] <= 1
    assert list(result["workloads"]) == ["first-line", "edit"] and result["workloads"]["first-line"] == {
        key: value for key, value in result.items() if key != "workloads"}
    edit = result["workloads"]["edit"]
    assert list(edit["heads"]) == list(result["heads"]) and edit["prompt_tokens"] > 16
    assert list(edit["speed"]) == ["plain", *result["heads"]]
    assert (out / "acceptance.md").read_text().startswith("## Summary")
    assert (out / "acceptance.png").is_file() == bool(importlib.util.find_spec("matplotlib"))


def test_speed_is_the_median_run_and_the_speedup_the_median_in_run_ratio():
    from tllm_spec.tools.acceptance_eval import _median_ratio, _median_run

    plain = [{"tokens_per_s": t} for t in (100.0, 50.0, 80.0)]  # the second repeat ran on a loaded machine
    spec = [{"tokens_per_s": t} for t in (150.0, 100.0, 150.0)]
    assert _median_run(plain)["tokens_per_s"] == 80.0 and _median_run(spec)["tokens_per_s"] == 150.0
    assert _median_ratio(spec, plain) == 1.875  # ratios 1.5, 2.0, 1.875: not 150 / 80
