"""The long-context benchmark (scripts/benchmark.py --context) without a GPU: its flags, the roofline and pool
arithmetic on hand-computed cases, the rows a tiny CPU run writes, the attention entries and the plot. The
timings themselves are never asserted."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from tllm_spec.sampling.forcing import ENV_VAR
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools import context_report
from tllm_spec.tools.attention_bench import (
    VerifyShape,
    attention_entries,
    kv_bytes_read,
    xqa_causal_mask,
)
from tllm_spec.tools.benchmark import step_bytes
from tllm_spec.tools.context_bench import (
    ContextPoint,
    context_points,
    kv_bytes_per_token,
    measure_context_point,
    plan_points,
    prefill_groups,
    random_target,
    roofline_fraction,
    skipped_point,
)
from tllm_spec.tools.context_report import plot_context, table
from tllm_spec.tools.random_models import target_config

from ..models import eagle3, tiny_pair

POINT_KEYS = {"batch", "context", "mode", "forced_drafts", "step_ms", "roofline_fraction",
              "prefill_tokens_per_second", "ttft_s", "skipped"}




def parse(script, monkeypatch, *argv: str):
    monkeypatch.setattr(sys, "argv", ["benchmark.py", *argv])
    return script.parse_args()


def test_context_flags_parse_and_refuse_without_context(script, monkeypatch):
    args = parse(script, monkeypatch, "--context", "2048", "8192", "--batches", "1", "8", "--attention-backends",
                 "old", "xqa", "--context-json", "docs/x.json", "--no-compile")
    assert args.context == [2048, 8192] and args.batches == [1, 8] and args.attention_backends == ["old", "xqa"]
    assert args.context_json == "docs/x.json" and args.no_compile and args.kv_cache_fraction == 0.7
    assert parse(script, monkeypatch).context is None
    for argv in (["--attention-backends", "old"], ["--context", "2048", "--attention-backends", "bogus"],
                 ["--context", "2048", "--attention-only"], ["--context", "2048", "--kv-cache-fraction", "1.5"]):
        with pytest.raises(SystemExit):
            parse(script, monkeypatch, *argv)


def test_roofline_of_a_hand_computed_step():
    # batch 8 x 32768 tokens x 2 (K, V) x 32 layers x 8 heads x 128 x 2 bytes = 32 GiB
    kv = kv_bytes_read(8, 32768, 32, 8, 128, 2)
    assert kv == 32 * 2**30
    # 16 GB of weights and 32 GiB of KV at 3 TB/s take 16.79 ms; a 20 ms step reaches 83.9 % of that
    assert roofline_fraction(16e9 + kv, 3e12, 20.0) == pytest.approx((16e9 + 34359738368) / 3e12 / 0.020)
    assert roofline_fraction(3e9, 3e12, 1.0) == pytest.approx(1.0)
    config = target_config("llama", num_hidden_layers=32, num_key_value_heads=8, num_attention_heads=32,
                           hidden_size=4096)
    assert kv_bytes_per_token(config) == 2 * 33 * 8 * 128 * 2  # 32 target layers and the draft's one
    assert kv_bytes_per_token(config, draft_layers=0, dtype_bytes=4) == 2 * 32 * 8 * 128 * 4
    assert VerifyShape(8, 32764).kv_bytes == 8 * 32768 * 2 * 8 * 128 * 2  # the 4 query tokens' K/V included


def test_prefill_groups_take_whole_prompts_within_the_budget():
    assert prefill_groups(8, 2048, 65536) == [range(8)]
    assert prefill_groups(8, 32768, 65536) == [range(2), range(2, 4), range(4, 6), range(6, 8)]
    assert prefill_groups(2, 131072, 65536) == [range(1), range(1, 2)]  # a longer prompt still goes whole


def test_plan_skips_points_whose_kv_does_not_fit_and_sizes_the_pool_for_the_largest_other():
    # K = 3, 128 timed new tokens: a request reserves its prompt, 2 x 128 new tokens and K + 1 for each prefill
    # step (a step per 16384 prompt tokens of the batch, the default chunk, one more per group) and 7 positions
    # past them, in pages of 16; the pool has one scratch page more
    plan = plan_points([1, 8], [2048, 8192], 128, 3, bytes_per_token=1000, budget_bytes=20e6, max_prefill_tokens=65536)
    assert plan.skipped.keys() == {(8, 8192)}  # 8 x 530 + 1 pages x 16 tokens x 1000 bytes = 67.9 MB
    assert "needs 0.1 GiB" in plan.skipped[(8, 8192)]
    assert plan.num_pages == 8 * 145 + 1  # batch 8 x ceil((2048 + 256 + 2 x 4 + 7) / 16), above batch 1 x 529
    assert plan.max_seq_len == 8192 + 256 + 2 * 4
    # four prefill groups: one more step of K + 1 tokens for each
    grouped = plan_points([8], [2048], 128, 3, 1000, 20e6, max_prefill_tokens=4096)
    assert grouped.num_pages == 8 * 146 + 1 and grouped.max_seq_len == 2048 + 256 + (1 + 4) * 4
    # a long batch's chunks: 8 x 32k prompt tokens take 16 prefill steps of 16384 (the early requests decode in them)
    chunked = plan_points([8], [32768], 128, 3, 1000, 1e12, max_prefill_tokens=65536)
    assert chunked.max_seq_len == 32768 + 256 + (16 + 4) * 4


@pytest.mark.parametrize("spec", [True, False])
def test_a_tiny_cpu_run_writes_the_point_schema(monkeypatch, spec):
    monkeypatch.setenv(ENV_VAR, "0")  # restored afterwards: the point sets it
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, eagle3(head, 3) if spec else None, max_batch_size=2)
    free_pages = model.runner.kv_cache.num_free_pages
    forced = 3.0 if spec else None
    # two prompts of 40 tokens, prefilled one per step (max_prefill_tokens 40), then the batch of 2 decodes
    point = measure_context_point(model, 2, 40, 12, forced, bandwidth=1e9, max_prefill_tokens=40)
    row = json.loads(json.dumps(vars(point)))
    assert POINT_KEYS <= row.keys() and row.keys() == set(skipped_point(2, 40, "none", None, "why"))
    assert (row["batch"], row["context"], row["mode"], row["forced_drafts"]) == (2, 40, "eagle3" if spec else "none",
                                                                                 forced)
    assert row["skipped"] is None and row["draft_len"] == (3 if spec else 0)
    assert row["prefill_steps"] >= 2 and row["decode_steps"] >= 1 and row["mean_decode_batch"] == 2.0
    assert 40 < row["mean_context"] < 40 + 2 * 12 + 2 * 4
    assert row["roofline_bytes_per_step"] == step_bytes(model, 2, row["mean_context"], row["draft_len"])
    assert row["roofline_fraction"] == pytest.approx(row["roofline_bytes_per_step"] / 1e9 / (row["step_ms"] / 1e3))
    assert row["prefill_tokens_per_second"] == pytest.approx(2 * 40 / row["ttft_s"])
    assert model.engine.num_requests == 0 and model.runner.kv_cache.num_free_pages == free_pages


def test_context_points_measure_each_mode_on_one_target_and_skip_what_does_not_fit(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, "0")
    target = random_target("tiny", device="cpu")
    per_token = kv_bytes_per_token(target.config)
    budget = 13 * 16 * per_token  # 13 pages: batch 2 x 64 needs 2 x 6 + 1, batch 2 x 96 (two groups) 2 x 8 + 1
    plan = plan_points([1, 2], [64, 96], 8, 3, per_token, budget, max_prefill_tokens=128)
    assert plan.skipped.keys() == {(2, 96)}
    rows = list(context_points(target, plan, [1, 2], [64, 96], 3, 8, 1e9, 128, False, tmp_path, ("auto", "fp8")))
    assert [(r["kv_cache_dtype"], r["mode"], r["batch"], r["context"]) for r in rows] == [
        (kv, mode, b, c) for kv in ("auto", "fp8") for mode in ("none", "eagle3")
        for b, c in ((2, 96), (1, 64), (1, 96), (2, 64))]
    for r in rows:
        assert r.keys() == {*skipped_point(1, 1, "none", None, ""), "kv_cache_dtype"} and r["forced_drafts"] == (
            3.0 if r["mode"] == "eagle3" else None)
        assert (r["skipped"] is not None) == ((r["batch"], r["context"]) == (2, 96))
        assert r["skipped"] or (r["step_ms"] > 0 and r["mean_decode_batch"] == r["batch"])


def test_attention_entries_time_what_is_there_and_say_why_the_rest_is_not():
    entries = list(attention_entries(["old", "split", "flashinfer", "xqa"], [1, 2], [40], 1e9, torch.device("cpu"),
                                     iters=2))
    assert [(e["backend"], e["batch"]) for e in entries] == [(b, n) for n in (1, 2)
                                                            for b in ("old", "split", "flashinfer", "xqa")]
    old = [e for e in entries if e["backend"] == "old"]
    assert old[0]["max_abs_error"] == 0.0 and old[1]["max_abs_error"] is None  # checked on the first shape only
    for e in old:
        assert e["unavailable"] is None and e["kv_bytes"] == VerifyShape(e["batch"], 40).kv_bytes
        assert e["roofline_fraction"] == pytest.approx(e["kv_bytes"] / (e["us_per_call"] * 1e-6) / 1e9)
    for e in entries:
        assert (e["us_per_call"] is None) == bool(e["unavailable"])
        if e["backend"] in ("flashinfer", "xqa"):
            assert "CUDA" in e["unavailable"]


def test_xqa_mask_lets_row_i_see_drafts_0_to_i():
    mask = xqa_causal_mask(2, 4, "cpu")
    assert mask.dtype == torch.uint16 and mask.shape == (2, 4, 2)
    assert mask.view(torch.int32).flatten().tolist() == [1, 3, 7, 15] * 2


def _results() -> dict:
    measured = ContextPoint(1, 2048, "eagle3", 3.0, 3, 5.0, 30, 1.0, 2100.0, 1.5e10, 0.75, 0.1, 1, 20480.0, 20.0)
    points = [vars(measured), {**vars(measured), "context": 8192, "roofline_fraction": 0.7},
              skipped_point(8, 131072, "none", None, "KV needs 132.0 GiB")]
    attention = [{"backend": "old", "batch": 1, "context": c, "query_len": 4, "kv_bytes": 1e6, "us_per_call": 5.0,
                  "roofline_fraction": f, "timing": "cuda graph", "max_abs_error": None, "unavailable": None}
                 for c, f in ((2048, 0.3), (8192, 0.6))]
    attention.append({**attention[0], "backend": "xqa", "us_per_call": None, "roofline_fraction": None,
                      "unavailable": "flashinfer is not installed"})
    return {"kind": "context", "gpu": "test GPU", "shape": "llama-3.1-8b", "k": 3, "new_tokens": 128,
            "date": "2026-01-01", "bandwidth_bytes_per_s": {"gemv": 3e12}, "points": points, "attention": attention}


def test_table_lists_measured_skipped_and_unavailable_entries():
    text = table(_results())
    assert "| EAGLE-3 (3 drafts forced) | 1 | 2048 | 5.00 | 75.0% |" in text
    assert "skipped: KV needs 132.0 GiB" in text and "unavailable: flashinfer is not installed" in text


def test_plot_writes_a_file_and_plot_only_replots_a_context_json(script, monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    assert plot_context(_results(), tmp_path / "context.png") == tmp_path / "context.png"
    assert (tmp_path / "context.png").stat().st_size > 0
    (tmp_path / "run.json").write_text(json.dumps(_results()))
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--plot-only", str(tmp_path / "run.json")])
    script.main()
    assert (tmp_path / "run.png").stat().st_size > 0


@pytest.mark.slow  # real processes or compiles: ten seconds or more (the second CI command)
def test_the_script_runs_the_whole_context_benchmark_on_the_cpu_with_the_gpu_parts_stubbed(script, monkeypatch,
                                                                                          tmp_path):
    """--context end to end on a tiny target: the bandwidth probe, the GPU's name and free memory are stubbed and
    the attention and decode points run on the CPU; both JSON copies hold every row, and the plots exist."""
    monkeypatch.setenv(ENV_VAR, "0")
    monkeypatch.setattr(context_report, "measure_bandwidth", lambda device: {"gemv": 1e9, "read": 1e9})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "CPU standing in")
    monkeypatch.setattr(context_report, "random_target", lambda shape: random_target(shape, device="cpu"))
    monkeypatch.setattr(context_report, "plan_for", lambda target, batches, contexts, new_tokens, k, fraction, cap:
                        plan_points(batches, contexts, new_tokens, k, kv_bytes_per_token(target.config), 1e6, cap))
    real_entries = context_report.attention_entries
    monkeypatch.setattr(context_report, "attention_entries", lambda backends, batches, contexts, bandwidth, device:
                        real_entries(backends, batches, contexts, bandwidth, torch.device("cpu"), iters=2))
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--shape", "tiny", "--context", "48", "600", "--batches", "1",
                                      "2", "--new-tokens", "8", "--attention-backends", "old", "xqa", "--out",
                                      str(tmp_path / "run"), "--context-json", str(tmp_path / "docs" / "copy.json")])
    script.main()
    results = json.loads((tmp_path / "run" / "context.json").read_text())
    assert results == json.loads((tmp_path / "docs" / "copy.json").read_text()) and results["kind"] == "context"
    assert {(p["mode"], p["batch"], p["context"]) for p in results["points"]} == {
        (m, b, c) for m in ("none", "eagle3") for b in (1, 2) for c in (48, 600)}
    skipped = {(p["batch"], p["context"]) for p in results["points"] if p["skipped"]}
    assert skipped == {(2, 600)}  # (2 x 40 + 1) pages x 16 tokens x 1152 bytes > 1 MB; 1 x 600 fits
    assert all(p["step_ms"] > 0 for p in results["points"] if not p["skipped"])
    assert [(a["backend"], a["batch"], a["context"]) for a in results["attention"]] == [
        (n, b, c) for b in (1, 2) for c in (48, 600) for n in ("old", "xqa")]
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "run" / "context.png").exists() and (tmp_path / "docs" / "copy.png").exists()
