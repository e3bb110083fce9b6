"""The evaluation over workloads: the prompts of each workload, every method on each (tiny random models), the
summary table, the report and the plot."""
import importlib.util

import pytest

from tllm_spec.demo import resolve
from tllm_spec.tokenizer import load_tokenizer
from tllm_spec.tools.acceptance_eval import head_configs, heldout_texts
from tllm_spec.tools.eval_workloads import (
    evaluate_workloads,
    format_report,
    plot,
    summary_table,
    workload_prompts,
)
from tllm_spec.tools.workloads import EDIT_REQUEST

from ..models import tiny_pair

K = 3


def test_each_workload_has_its_prompts():
    tokenizer = load_tokenizer(resolve("demo://target"))
    prompts = workload_prompts(["edit", "first-line"], tokenizer, heldout_texts(), 3, 16)
    assert list(prompts) == ["edit", "first-line"]
    assert [len(p) for p in prompts["first-line"]] == [16, 16, 16]
    assert len(prompts["edit"]) == 3 and all(len(p) > 16 for p in prompts["edit"])
    request = EDIT_REQUEST.split("{")[0]  # "# The same function, with the parameter "
    assert all(request in tokenizer.decode(p) for p in prompts["edit"])


@pytest.mark.slow  # ten seconds or more on the 2-core CI machine
def test_every_method_on_every_workload(tmp_path):
    target, head = tiny_pair("llama")
    # the target drafting for itself: every greedy draft accepted, so its T=0 rows are known exactly
    heads = head_configs(str(head), None, K, draft=str(target), sa_k=4, sa_spec_threshold=2)
    prompts = {"first-line": [[5, 17, 3, 44, 9, 2, 71], [12, 8, 40, 41, 42, 3, 4]],
               "edit": [[60, 61, 62, 63, 64, 65, 66, 67, 1, 60, 61, 62], [9, 8, 7, 6, 9, 8, 7, 6, 9, 8]]}
    result = evaluate_workloads(str(target), heads, prompts, 8, speed_prompts=1, repeats=1, progress=False)
    assert list(result["workloads"]) == ["first-line", "edit"]
    assert result["heads"] is result["workloads"]["first-line"]["heads"]  # the layout before workloads
    assert result["prompt_tokens"] == 7 and result["workloads"]["edit"]["prompt_tokens"] == 11
    for entry in result["workloads"].values():
        assert list(entry["heads"]) == ["eagle3", "draft_target", "sa", "eagle3+sa"]
        for name, head_result in entry["heads"].items():
            assert head_result["T=0"]["prompts_matching_plain"] == 2, name  # speculation keeps greedy output
            assert head_result["T=1"]["num_tokens"] == 16
        assert entry["heads"]["draft_target"]["T=0"]["histogram"] == [0, 0, 0, 4]  # each step accepts K + 1
        assert set(entry["speed"]) == {"plain", *heads} and entry["speed"]["sa"]["speedup"] > 0

    table = summary_table(result).split("\n")
    assert table[0] == ("| method | first-line T=0 | first-line T=1 | first-line speedup | edit T=0 | edit T=1 "
                        "| edit speedup |")
    assert table[2].startswith("| plain | 1.00 | 1.00 | ") and table[4].startswith("| draft_target | 4.00 | 4.00 | ")
    assert len(table) == 2 + 1 + len(heads)
    report = format_report(result)
    assert report.count("| none (plain) | 0 |") == 2 and "## edit: 2 prompts of 11 tokens (mean)" in report
    path = plot(result, tmp_path / "a.png")
    if importlib.util.find_spec("matplotlib"):
        assert path.is_file() and path.stat().st_size > 1000
    else:
        assert path is None
