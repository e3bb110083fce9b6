"""The start-up benchmark (tllm_spec/tools/startup.py) end to end on the CPU: two real child processes on one
fresh cache directory, each built, warmed up and serving mixed batches at every bucket; the report's fields."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tllm_spec.tools.startup import mixed_params, run_startup


@pytest.mark.slow  # real processes or compiles: ten seconds or more (the second CI command)
def test_startup_report_from_two_fresh_processes(tmp_path):
    out = tmp_path / "startup.json"
    result = run_startup("tiny", 2, "cpu", out)
    assert json.loads(out.read_text()) == result
    for run in ("fresh", "warm"):
        child = result[run]
        assert child["ready_s"] > 0 and list(child["phases_s"]) == [
            "interpreter_and_imports", "build_target", "write_draft_checkpoint", "build_spec_model", "warmup"]
        assert abs(sum(child["phases_s"].values()) - child["ready_s"]) < 1e-6
        assert child["served_buckets"] == [1, 2]
    assert result["fresh_ready_s"] == result["fresh"]["ready_s"] and result["warm_ready_s"] == result["warm"]["ready_s"]
    assert result["compiles_after_ready"] == 0 and result["captures_after_ready"] == 0  # the CPU compiles nothing
    assert result["triton_variants_after_ready"] in (0, None)
    assert result["gpu_test_suite_s"] is None
    assert result["writes_bytecode"] is not bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))  # the children's env
    assert out.with_suffix(".png").exists() is (importlib.util.find_spec("matplotlib") is not None)


def test_mixed_batches_cycle_through_greedy_sampled_and_seeded():
    params = mixed_params(5, guided=False)
    assert [(p.temperature > 0, p.seed is not None) for p in params] == \
        [(False, False), (True, False), (True, True), (False, False), (True, False)]
    assert mixed_params(4, guided=True)[3].guided_decoding is not None


def test_triton_variants_are_counted_per_package():
    from tllm_spec.tools.startup import num_triton_variants
    count = num_triton_variants()
    assert count is None or count >= 0
    assert num_triton_variants("no_such_package") in (0, None)


def test_gpu_test_suite_is_timed_from_an_empty_cache_directory(monkeypatch):
    import sys

    from tllm_spec.tools import startup

    script = ("import os, sys; d = os.environ['TLLM_SPEC_CACHE_DIR']; print('warming'); "
              "print(len(os.listdir(d)), 'cached'); print('a warning', file=sys.stderr)")
    monkeypatch.setattr(startup, "gpu_test_command", lambda: [sys.executable, "-c", script])
    result = startup.time_gpu_tests(60.0)
    assert result["gpu_test_suite_rc"] == 0 and result["gpu_test_suite_summary"] == "0 cached"
    assert result["gpu_test_suite_s"] > 0 and result["gpu_test_suite_command"] == script
    assert result["gpu_test_suite_failed"] == []
    failed_line = "FAILED tests/gpu/test_x.py::test_y - AssertionError"
    failing = [sys.executable, "-c", f"print({failed_line!r}); raise SystemExit(3)"]
    monkeypatch.setattr(startup, "gpu_test_command", lambda: failing)
    result = startup.time_gpu_tests(60.0)
    assert result["gpu_test_suite_rc"] == 3 and result["gpu_test_suite_failed"] == ["tests/gpu/test_x.py::test_y"]
