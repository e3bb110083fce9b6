"""The CPU prefill benchmark (scripts/cpu_prefill_bench.py over tllm_spec/tools/prefill_bench.py) on a tiny prompt of
the demo target: the JSON it prints, both sides timed on the same prompt and agreeing on the next token. The
timings themselves are never asserted."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tllm_spec.tools.prefill_bench import random_prompt

SCRIPT = Path(__file__).parents[2] / "scripts" / "cpu_prefill_bench.py"


def test_the_script_prints_both_times_and_their_ratio(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("cpu_prefill_bench", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", ["cpu_prefill_bench.py", "--prompt-tokens", "40", "--repeats", "2",
                                      "--max-num-batched-tokens", "16"])
    script.main()
    result = json.loads(capsys.readouterr().out)
    assert result["prompt_tokens"] == 40 and result["max_num_batched_tokens"] == 16  # three prompt steps
    assert len(result["engine_runs_s"]) == len(result["transformers_runs_s"]) == 2
    assert result["engine_s"] == pytest.approx(sum(result["engine_runs_s"]) / 2)  # the median of two runs
    assert result["transformers_s"] == pytest.approx(sum(result["transformers_runs_s"]) / 2)
    assert result["ratio"] == pytest.approx(result["engine_s"] / result["transformers_s"])
    assert result["same_next_token"]  # the chunked prompt through the engine picks transformers' greedy token


def test_the_prompt_is_the_same_every_run_and_inside_the_vocabulary():
    prompt = random_prompt(50, 300, seed=1)
    assert prompt == random_prompt(50, 300, seed=1) != random_prompt(50, 300, seed=2)
    assert len(prompt) == 300 and 0 <= min(prompt) and max(prompt) < 50
