"""The prefix-caching benchmark (tllm_spec/tools/prefix_cache_bench.py): the ideal a perfect cache reaches on each
workload, the targets' verdicts, and end to end on the CPU (a tiny random model, the real uvicorn server, the
bench-serve child process): the cache-on run hits, the cache-off run does not."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("uvicorn")
from tllm_spec.sampling.forcing import ENV_VAR  # noqa: E402
from tllm_spec.tools.prefix_cache_bench import (  # noqa: E402
    Workload,
    format_table,
    ideal_per_request,
    run,
    verdict,
    workloads,
)

PAGE = 16


def record(start: float, prompt_tokens: int, output_tokens: int = 8, ok: bool = True, conversation: int | None = None,
           turn: int | None = None, cached_tokens: int | None = None) -> dict:
    return {"start": start, "ok": ok, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "conversation": conversation, "turn": turn, "cached_tokens": cached_tokens}


def test_the_targets_loads_are_the_defaults():
    shared, multi = workloads()
    assert (shared.dataset, shared.shared_prefix_len, shared.question_len, shared.output_len) == (
        "shared-prefix", 4096, 128, 128)
    assert (shared.concurrency, shared.num_prompts, multi.turns) == (16, 256, 8)
    flags = multi.flags(vocab_size=100, seed=3)
    assert flags[flags.index("--dataset") + 1] == "multi-turn" and flags[flags.index("--turns") + 1] == "8"
    assert "--shared-prefix-len" in shared.flags(100, 0) and shared.warmup().num_prompts == 16
    assert multi.warmup().turns == 2


def test_ideal_of_a_shared_prefix_every_request_but_the_first_whole_pages_of_the_prefix():
    load = Workload(dataset="shared-prefix", num_prompts=4, concurrency=2, question_len=8, output_len=8,
                    shared_prefix_len=40)
    requests = [record(0.2, 48), record(0.0, 48), record(0.1, 48, ok=False), record(0.3, 48)]
    ideal = ideal_per_request(requests, load, PAGE)
    assert [(r["start"], n) for r, n in ideal] == [(0.0, 0), (0.2, 32), (0.3, 32)]  # 40 tokens: 2 whole pages
    assert [n for _, n in ideal_per_request(requests, load.model_copy(update={"shared_prefix_len": 48}), PAGE)] == [
        0, 32, 32]  # the last prompt token is left to compute: 47 cached at most, 2 pages


def test_ideal_of_a_conversation_the_previous_prompt_and_its_completion():
    load = Workload(dataset="multi-turn", num_prompts=2, concurrency=2, question_len=20, output_len=20, turns=3)
    requests = [record(0.0, 20, 20, conversation=0, turn=0), record(1.0, 60, 20, conversation=0, turn=1),
                record(2.0, 100, 20, conversation=0, turn=2), record(0.0, 20, 20, conversation=1, turn=0),
                record(1.0, 60, 20, ok=False, conversation=1, turn=1), record(2.0, 100, 20, conversation=1, turn=2)]
    with_outputs = {(r["conversation"], r["turn"]): n for r, n in ideal_per_request(requests, load, PAGE)}
    assert with_outputs == {(0, 0): 0, (0, 1): 32, (0, 2): 80, (1, 0): 0, (1, 2): 0}  # 40 -> 32, 80 -> 80
    prompts_only = {(r["conversation"], r["turn"]): n for r, n in ideal_per_request(requests, load, PAGE, False)}
    assert prompts_only == {(0, 0): 0, (0, 1): 16, (0, 2): 48, (1, 0): 0, (1, 2): 0}  # 20 -> 16, 60 -> 48


def test_verdict_ratios_and_targets():
    load = workloads(("multi-turn",))[0]
    on = {"summary": {"ttft_ms": {"p50": 20.0}, "output_throughput": 160.0}, "pages_short_per_request": 1.5}
    off = {"summary": {"ttft_ms": {"p50": 100.0}, "output_throughput": 100.0}}
    out = verdict(load, on, off)
    assert out["ttft_p50_on_over_off"] == pytest.approx(0.2) and out["output_throughput_on_over_off"] == 1.6
    assert {k: v["met"] for k, v in out["targets"].items()} == {  # multi-turn's TTFT ratio: reported, no target
        "output_throughput_on_over_off": True, "pages_short_per_request": False}
    assert verdict(workloads(("shared-prefix",))[0], on, off)["targets"]["ttft_p50_on_over_off"]["met"]
    on["summary"]["output_throughput"] = 140.0  # 1.4x: enough for shared-prefix (1.3), not multi-turn (1.5)
    assert not verdict(load, on, off)["targets"]["output_throughput_on_over_off"]["met"]
    assert verdict(workloads(("shared-prefix",))[0], on, off)["targets"]["output_throughput_on_over_off"]["met"]


@pytest.mark.slow  # real processes: ten seconds or more (the second CI command)
def test_the_cache_on_run_hits_and_the_cache_off_run_does_not(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "0")  # restored afterwards: the run forces acceptance in this process
    loads = workloads(concurrency=2, num_prompts=4, shared_prefix_len=40, question_len=20, output_len=4, turns=2,
                      num_conversations=2)
    result = run(loads, tmp_path, shape="tiny", forced=2.0, device="cpu", warmup=False)
    assert json.loads((tmp_path / "prefix_cache_bench.json").read_text()) == result
    assert result["page_size"] == PAGE and [w["workload"]["dataset"] for w in result["workloads"]] == [
        "shared-prefix", "multi-turn"]
    for entry in result["workloads"]:
        on, off = entry["on"], entry["off"]
        assert {"ttft_p50_on_over_off", "output_throughput_on_over_off", "pages_short_per_request", "targets"} <= set(
            entry)
        assert on["summary"]["num_completed"] == off["summary"]["num_completed"] == 4
        assert on["num_prompt_tokens"] == off["num_prompt_tokens"] > 0
        assert 0 < on["hit_rate"] <= on["ideal_hit_rate"] and on["cached_tokens"] % PAGE == 0
        assert off["hit_rate"] == 0 and off["engine_cached_tokens"] == 0
        assert on["engine_cached_tokens"] == on["cached_tokens"]  # the engine's counter and the usage agree
        assert on["ideal_cached_tokens"] == off["ideal_cached_tokens"] > 0  # the same prompts
        assert entry["ttft_p50_on_over_off"] == pytest.approx(
            on["summary"]["ttft_ms"]["p50"] / off["summary"]["ttft_ms"]["p50"])
    assert (tmp_path / "multi-turn-off" / "bench_serving.json").is_file()
    table = format_table(result)
    assert table.splitlines()[1].startswith("shared-prefix  on") and "multi-turn:" in table
