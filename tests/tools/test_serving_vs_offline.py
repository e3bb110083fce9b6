"""The server-against-offline benchmark (tllm_spec/tools/serving_vs_offline.py) end to end on the CPU: a tiny
random model, offline generate(), the real uvicorn server and the bench-serve child process; the report's ratios
compare the server with offline decoding of the same prompts."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("uvicorn")
from tllm_spec.sampling.forcing import ENV_VAR  # noqa: E402
from tllm_spec.tools.serving_vs_offline import run  # noqa: E402


@pytest.mark.slow  # real processes or compiles: ten seconds or more (the second CI command)
def test_report_compares_the_server_with_offline_generate_of_the_same_prompts(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "0")  # restored afterwards: the run forces acceptance in this process
    result = run("tiny", 2.0, [1, 4], num_prompts=8, input_len=8, output_len=8, out_dir=tmp_path, device="cpu")
    assert json.loads((tmp_path / "serving_vs_offline.json").read_text()) == result
    one, four = result["points"]
    assert one["offline"]["prompts"] == 1 and "offline_same_prompts" not in one  # concurrency 1: the TPOT target
    assert four["offline"]["prompts"] == 4 and four["offline_same_prompts"]["prompts"] == 8  # all the server's
    assert four["offline_same_prompts"]["output_tokens"] == 8 * 8 == four["server"]["num_output_tokens"]
    same, batch = four["offline_same_prompts"]["tokens_per_second"], four["offline"]["tokens_per_second"]
    throughput = four["server"]["output_throughput"]
    assert four["server_over_offline_throughput"] == pytest.approx(throughput / same)
    assert four["server_over_offline_one_batch_throughput"] == pytest.approx(throughput / batch)
    assert one["server_tpot_over_offline_step_per_token"] == pytest.approx(
        one["server"]["tpot_ms"]["mean"] / one["offline"]["step_ms_per_token"])
    for steps, name in [(four["offline_same_prompts"]["steps"], "steps-offline-8.json"),
                        (four["server"]["steps"], "steps-concurrency-4.json")]:  # every prompt token prefilled once
        records = json.loads((tmp_path / name).read_text())
        assert steps["steps"] == len(records) and sum(r["prompt_tokens"] for r in records) == 8 * 8
        assert steps["prefill_steps"] == sum(r["prompt_tokens"] > 0 for r in records) >= 1


@pytest.mark.slow  # real processes or compiles: ten seconds or more (the second CI command)
def test_repeats_report_the_median_run(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "0")
    result = run("tiny", 2.0, [4], num_prompts=8, input_len=8, output_len=4, out_dir=tmp_path, device="cpu",
                 repeats=3)
    point = result["points"][0]
    runs = [r["output_throughput"] for r in point["server_runs"]]
    assert len(runs) == 3 and runs == sorted(runs) and point["server"]["output_throughput"] == runs[1]
    offline_runs = point["offline_same_prompts"]["runs_tokens_per_second"]
    assert len(offline_runs) == 3
    assert point["offline_same_prompts"]["tokens_per_second"] == pytest.approx(sorted(offline_runs)[1])
    assert point["server_over_offline_throughput"] == pytest.approx(runs[1] / sorted(offline_runs)[1])
    assert {f"steps-concurrency-4-run{r}.json" for r in range(3)} <= {p.name for p in tmp_path.iterdir()}
