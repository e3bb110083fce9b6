"""scripts/tree_benchmark.py's pure parts: variant names, the summary against the baseline chain, the table."""
import importlib.util
import sys
from pathlib import Path

import pytest

from tllm_spec import Eagle3Config
from tllm_spec.drafts.tree import DEFAULT_EAGLE_CHOICES
from tllm_spec.tools.tree_report import summarise, table, variant_fields

SCRIPT = Path(__file__).parents[2] / "scripts" / "tree_benchmark.py"


def test_variant_names_give_valid_draft_configs():
    assert variant_fields("chain:3") == {"max_draft_len": 3}
    static = variant_fields("static:default")
    assert static["max_draft_len"] == 7 and static["eagle_choices"] == [list(c) for c in DEFAULT_EAGLE_CHOICES]
    assert variant_fields("static:[[0], [1], [0, 0]]") == {"max_draft_len": 2, "eagle_choices": [[0], [1], [0, 0]]}
    dynamic = variant_fields("dynamic:4:32:7")
    assert dynamic == {"max_draft_len": 7, "use_dynamic_tree": True, "dynamic_tree_max_topK": 4,
                       "max_total_draft_tokens": 32}
    for fields in (static, dynamic):
        Eagle3Config(speculative_model="demo://eagle3", **fields)  # the config accepts what the names give
    for bad in ("tree:3", "dynamic:4:32", "static:[[0", "chain:x"):
        with pytest.raises(ValueError):
            variant_fields(bad)


def _point(variant, batch, step_ms, tokens_per_step, decoding):
    return {"variant": variant, "batch": batch, "step_ms": step_ms, "tokens_per_step": tokens_per_step,
            "tokens_per_second": decoding * tokens_per_step / (step_ms / 1e3)}


def test_summary_divides_by_the_baseline_and_picks_the_fastest_at_the_heads_acceptance():
    result = {"gpu": "G", "shape": "s", "prompt_len": 8, "new_tokens": 8, "compiled": True, "date": "d",
              "accepted": {"chain:3": 3.5, "static:default": 7.0},
              "variants": {v: {"verified_tokens": n} for v, n in (("chain:3", 4), ("static:default", 26),
                                                                   ("dynamic:4:32:7", 33))},
              "points": [_point("chain:3", 1, 10.0, 4.0, 1), _point("chain:3", 8, 20.0, 4.0, 8),
                         _point("static:default", 1, 15.0, 8.0, 1), _point("static:default", 8, 50.0, 8.0, 8),
                         _point("dynamic:4:32:7", 1, 16.0, 3.0, 1)]}
    out = summarise(result)
    by = {(p["variant"], p["batch"]): p for p in out["points"]}
    assert out["baseline"] == "chain:3"
    assert by[("static:default", 1)]["step_vs_baseline"] == 1.5
    assert by[("chain:3", 1)]["head_tokens_per_second"] == pytest.approx(350.0)
    assert by[("chain:3", 8)]["head_tokens_per_second"] == pytest.approx(1400.0)  # 8 requests x 3.5 / 20 ms
    assert by[("static:default", 1)]["head_tokens_per_second_vs_baseline"] == pytest.approx(466.7 / 350, abs=1e-3)
    assert by[("dynamic:4:32:7", 1)]["head_tokens_per_second"] is None  # no acceptance given: step cost only
    assert out["fastest"] == {"1": "static:default", "8": "chain:3"}
    text = table(out)
    assert "| static:default | 26 | 1 | 15.00 | 1.500x | 7.00 | 466.7 | 1.333x |" in text
    assert "| dynamic:4:32:7 | 33 | 1 | 16.00 | 1.600x | - | - | - |" in text
    del result["accepted"]["chain:3"]  # a baseline without an acceptance: no ratio to it
    assert "| static:default | 26 | 1 | 15.00 | 1.500x | 7.00 | 466.7 | - |" in table(summarise(result))


def test_script_refuses_unknown_variants_and_stray_acceptance(monkeypatch):
    spec = importlib.util.spec_from_file_location("tree_benchmark", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", ["tree_benchmark.py", "--variants", "chain:3", "dynamic:2:8:4",
                                      "--accepted", "chain:3=3.58"])
    args = script.parse_args()
    assert args.accepted == {"chain:3": 3.58} and args.batches == [1, 8, 32]
    for argv in (["--variants", "chain:3", "bush:2"], ["--variants", "chain:3", "--accepted", "static:default=6"]):
        monkeypatch.setattr(sys, "argv", ["tree_benchmark.py", *argv])
        with pytest.raises(SystemExit):
            script.parse_args()
