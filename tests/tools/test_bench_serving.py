"""The serving benchmark against a real HTTP server started here: a fake OpenAI completions endpoint (FastAPI +
uvicorn in a thread) that streams a known number of chunks with known delays and token counts, and can answer
some requests with HTTP 429. Its model card states a vocabulary and a context length (as tllm-spec serve's do);
its second card does not (as other servers' may not). Its usage counts a prompt's ids (or words) and can report
cached prompt tokens as tllm-spec serve does (OpenAI's prompt_tokens_details, null until the last chunk)."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import threading
import time
from itertools import pairwise
from pathlib import Path

import pytest

pytest.importorskip("httpx")
fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from fastapi.responses import JSONResponse, StreamingResponse

from tllm_spec.tools import bench_serving_cli
from tllm_spec.tools.bench_datasets import file_prompts, random_prompts
from tllm_spec.tools.bench_report import compare, format_table, write_report
from tllm_spec.tools.bench_serving import BenchConfig, RequestRecord, poisson_arrivals, run_benchmark
from tllm_spec.tools.bench_stats import itl, percentile, stats_ms

FIRST_DELAY, DELAY = 0.05, 0.02  # s before the first chunk, between chunks
NUM_CHUNKS, TOKENS_PER_CHUNK = 5, 3
MODEL = "fake-model"
SERVED_VOCAB_SIZE, MAX_MODEL_LEN = 61, 1000  # more ids than the 50 the other tests draw from


class Fake:
    """What the fake server does next and what it was sent."""

    def __init__(self) -> None:
        self.usage = "continuous"  # "continuous": usage in every chunk; "final": only a last usage chunk; "none"
        self.fail_every = 0  # answer every n-th request (the n-th, 2n-th, ...) with HTTP 429
        self.send_done = True
        self.cached: int | None = None  # usage.prompt_tokens_details.cached_tokens of every request (None: absent)
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []


fake = Fake()
app = fastapi.FastAPI()


@app.get("/v1/models")
async def models() -> dict:
    return {"object": "list", "data": [{"id": MODEL, "object": "model", "vocab_size": SERVED_VOCAB_SIZE,
                                        "max_model_len": MAX_MODEL_LEN}, {"id": "other", "object": "model"}]}


@app.post("/v1/completions")
async def completions(request: fastapi.Request):
    body = await request.json()
    fake.bodies.append(body)
    fake.auth.append(request.headers.get("authorization"))
    if fake.fail_every and len(fake.bodies) % fake.fail_every == 0:
        return JSONResponse({"error": {"message": "rate limited"}}, status_code=429)
    num_prompt = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())
    return StreamingResponse(events(body["model"], num_prompt), media_type="text/event-stream")


def chunk(model: str, text: str, usage: int | None, num_prompt: int = 4, last: bool = False) -> str:
    out = {"id": "cmpl-1", "object": "text_completion", "model": model,
           "choices": [{"index": 0, "text": text, "finish_reason": None}] if text is not None else []}
    if usage is not None:
        out["usage"] = {"prompt_tokens": num_prompt, "completion_tokens": usage, "total_tokens": num_prompt + usage}
        if fake.cached is not None:
            out["usage"]["prompt_tokens_details"] = {"cached_tokens": fake.cached} if last else None
    return f"data: {json.dumps(out)}\n\n"


async def events(model: str, num_prompt: int = 4):
    await asyncio.sleep(FIRST_DELAY)
    yield ": keep-alive comment, not data\n\n"
    yield chunk(model, "", 0 if fake.usage == "continuous" else None, num_prompt)  # an empty delta: not a token
    for i in range(1, NUM_CHUNKS + 1):
        if i > 1:
            await asyncio.sleep(DELAY)
        yield chunk(model, "ab" * TOKENS_PER_CHUNK, i * TOKENS_PER_CHUNK if fake.usage == "continuous" else None,
                    num_prompt)
    if fake.usage != "none":
        yield chunk(model, None, NUM_CHUNKS * TOKENS_PER_CHUNK, num_prompt, last=True)
    if fake.send_done:
        yield "data: [DONE]\n\n"
        yield chunk(model, "after done", 99, num_prompt, last=True)  # must not be read


@pytest.fixture(scope="module")
def server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.started
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    thread.join(5)
    sock.close()


@pytest.fixture
def url(server):
    fake.__init__()
    return server


def config(url: str, **kw) -> BenchConfig:
    return BenchConfig(**{"base_url": url, "num_prompts": 8, "concurrency": 4, "random_input_len": 6,
                          "vocab_size": 50, "output_len": NUM_CHUNKS * TOKENS_PER_CHUNK, **kw})


def test_percentiles_and_stats_of_a_known_list():
    values = [float(v) for v in range(100, 0, -1)]  # 1..100, unsorted
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None
    assert stats_ms([1.0, 2.0, 6.0]) == {"mean": 3.0, "p50": 2.0, "p90": pytest.approx(5.2), "p99": pytest.approx(5.92)}
    assert stats_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_poisson_arrivals_reproducible_from_the_seed():
    a = poisson_arrivals(2000, 10.0, seed=3)
    assert a == poisson_arrivals(2000, 10.0, seed=3) and a != poisson_arrivals(2000, 10.0, seed=4)
    assert a[0] == 0.0 and all(t1 > t0 for t0, t1 in pairwise(a))
    assert a[-1] / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1 / rate


def test_prompts_random_in_vocab_and_from_a_file(tmp_path):
    ids = random_prompts(3, 5, 7, seed=1)
    assert ids == random_prompts(3, 5, 7, seed=1) and ids != random_prompts(3, 5, 7, seed=2)
    assert [len(p) for p in ids] == [5, 5, 5] and all(0 <= t < 7 for p in ids for t in p)
    path = tmp_path / "p.txt"
    path.write_text("héllo\n\n  \nline\\ntwo\n", encoding="utf-8")
    assert file_prompts(str(path), 5) == ["héllo", "line\ntwo", "héllo", "line\ntwo", "héllo"]


def test_parser_counts_tokens_from_usage_and_stops_at_done():
    rec = RequestRecord()
    for t, data in enumerate(['{"choices": [{"text": ""}], "usage": {"completion_tokens": 0}}',
                              '{"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}}',
                              '{"choices": [{"text": "bcd"}], "usage": {"completion_tokens": 4}}',
                              '{"choices": [], "usage": {"completion_tokens": 4}}', "[DONE]"]):
        rec.add_event(data, float(t))
    assert rec.done and rec.chunk_times == [1.0, 2.0] and rec.chunk_tokens == [1, 3]
    assert itl([1.0, 2.0, 2.6], [1, 3, 2]) == pytest.approx([1 / 3] * 3 + [0.3] * 2)
    plain = RequestRecord()
    for t, data in enumerate(['{"choices": [{"text": "a"}]}', '{"choices": [{"text": "b"}]}']):
        plain.add_event(data, float(t))
    assert plain.to_json()["output_tokens"] == 2 and plain.to_json()["token_count"] == "chunks"
    with pytest.raises(ValueError):
        plain.add_event('{"error": {"message": "boom"}}', 3.0)


def test_latencies_match_the_servers_delays(url, tmp_path):
    result = run_benchmark(config(url, api_key="sk-test", label="spec"))
    s = result["summary"]
    assert result["model"] == MODEL and result["label"] == "spec"  # the first id of /v1/models
    assert s["num_completed"] == 8 and s["num_failed"] == 0 and s["token_count"] == ["usage_per_chunk"]
    assert s["num_output_tokens"] == 8 * NUM_CHUNKS * TOKENS_PER_CHUNK and s["mean_tokens_per_chunk"] == 3
    for r in result["requests"]:
        assert r["chunk_tokens"] == [TOKENS_PER_CHUNK] * NUM_CHUNKS  # the empty delta and after-[DONE] chunk skipped
    ms = 1000 * FIRST_DELAY, 1000 * DELAY
    # lower bounds are exact (nothing arrives before the server sends it); upper ones leave a loaded 2-core CI
    # machine room and still catch a wrong unit or a clock started late
    slack = 2000
    assert ms[0] * 0.9 <= s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] < ms[0] + slack
    assert (NUM_CHUNKS - 1) * ms[1] / 14 * 0.9 <= s["tpot_ms"]["p50"] < ((NUM_CHUNKS - 1) * ms[1] + slack) / 14
    assert ms[1] / 3 * 0.5 <= s["itl_ms"]["p50"] < (ms[1] + 100) / 3  # a 20 ms gap over 3 tokens
    assert (ms[0] + (NUM_CHUNKS - 1) * ms[1]) * 0.9 <= s["e2e_ms"]["p50"] < ms[0] + (NUM_CHUNKS - 1) * ms[1] + slack
    assert s["output_throughput"] == pytest.approx(s["num_output_tokens"] / s["duration_s"])
    assert s["num_prompt_tokens"] == 8 * 6 and s["num_cached_tokens"] is None and s["prefix_cache_hit_rate"] is None
    body = fake.bodies[0]
    assert body["max_tokens"] == 15 and body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert len(body["prompt"]) == 6 and all(isinstance(t, int) and 0 <= t < 50 for t in body["prompt"])
    assert set(fake.auth) == {"Bearer sk-test"}


@pytest.mark.parametrize("usage, tokens, count", [("final", 15, "usage_total"), ("none", 5, "chunks")])
def test_token_count_without_usage_per_chunk(url, usage, tokens, count):
    fake.usage = usage
    result = run_benchmark(config(url, num_prompts=2, model="m", continuous_usage=False))
    assert [r["output_tokens"] for r in result["requests"]] == [tokens, tokens]
    assert result["summary"]["token_count"] == [count] and fake.bodies[0]["model"] == "m"
    assert result["requests"][0]["tpot"] == pytest.approx((result["requests"][0]["e2e"]
                                                           - result["requests"][0]["ttft"]) / (tokens - 1))


def test_failures_are_counted_not_raised(url):
    fake.fail_every = 2
    s = run_benchmark(config(url))["summary"]
    assert (s["num_completed"], s["num_failed"]) == (4, 4) and "429" in s["errors"][0]
    assert s["ttft_ms"]["p50"] is not None
    fake.fail_every, fake.send_done = 0, False
    s = run_benchmark(config(url, num_prompts=2))["summary"]
    assert s["num_failed"] == 2 and s["errors"] == ["stream ended before [DONE]"]
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    s = run_benchmark(config(dead, num_prompts=2, model="m"))["summary"]
    assert s["num_failed"] == 2 and s["errors"][0].startswith("ConnectError")


def test_poisson_load_sends_at_the_seeded_arrival_times(url):
    result = run_benchmark(config(url, num_prompts=6, concurrency=None, request_rate=20.0, seed=5))
    arrivals = poisson_arrivals(6, 20.0, seed=5)
    starts = [r["start"] for r in result["requests"]]
    assert all(a <= s < a + 0.1 for a, s in zip(arrivals, starts)), (arrivals, starts)
    assert result["summary"]["num_completed"] == 6


def test_report_json_plot_and_comparison(url, tmp_path):
    spec = run_benchmark(config(url, num_prompts=4, label="spec"))
    plain = {**spec, "label": "no-spec", "summary": {**spec["summary"],
                                                     "output_throughput": spec["summary"]["output_throughput"] / 2}}
    path = write_report(spec, tmp_path / "spec")
    assert json.loads(path.read_text())["summary"] == spec["summary"]
    (tmp_path / "plain.json").write_text(json.dumps(plain))
    table = compare([path, tmp_path / "plain.json"], tmp_path)
    lines = table.splitlines()
    assert lines[1].startswith("spec ") and "1.00x" in lines[1]
    assert lines[2].startswith("no-spec ") and "0.50x" in lines[2]
    assert format_table([spec]).splitlines()[1] == lines[1]
    pytest.importorskip("matplotlib")
    assert (tmp_path / "spec" / "bench_serving.png").stat().st_size > 0
    assert (tmp_path / "bench_serving_compare.png").stat().st_size > 0


def test_cli_runs_and_compares(url, tmp_path, capsys):
    script = Path(__file__).parents[2] / "scripts" / "bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving_cli", script)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    cli.main(["--base-url", url, "--num-prompts", "2", "--output-len", "15", "--label", "a", "--out",
              str(tmp_path / "a")])
    assert "wrote" in capsys.readouterr().out
    cli.main(["--compare", str(tmp_path / "a" / "bench_serving.json"), "--out", str(tmp_path)])
    assert capsys.readouterr().out.splitlines()[1].startswith("a ")
    with pytest.raises(SystemExit):
        cli.main(["--base-url", url, "--num-prompts", "0"])


def test_random_prompts_draw_from_the_served_models_vocabulary(url):
    result = run_benchmark(config(url, vocab_size=None, num_prompts=4, random_input_len=50))
    assert result["summary"]["num_failed"] == 0
    ids = [t for body in fake.bodies for t in body["prompt"]]
    assert len(ids) == 200 and all(0 <= t < SERVED_VOCAB_SIZE for t in ids) and max(ids) >= 50


@pytest.mark.parametrize("fields, words", [
    ({"vocab_size": SERVED_VOCAB_SIZE + 1}, ["62", "61 token ids"]),
    ({"vocab_size": None, "model": "other"}, ["'other'", "no vocab_size"]),
    ({"random_input_len": 990, "output_len": 15}, ["990 + 15", "max_model_len 1000"]),
    ({"dataset": "shared-prefix", "shared_prefix_len": 900, "question_len": 90}, ["990 + 15", "--shared-prefix-len"]),
    ({"dataset": "multi-turn", "turns": 3, "question_len": 320}, ["990 + 15", "--turns"])])
def test_a_load_the_served_model_cannot_take_is_refused_before_any_request(url, fields, words):
    with pytest.raises(ValueError) as err:
        run_benchmark(config(url, **fields))
    assert all(word in str(err.value) for word in words), str(err.value)
    assert fake.bodies == []


def test_the_cli_exits_1_when_a_request_failed_and_2_on_a_load_refused(url, tmp_path, capsys):
    argv = ["--base-url", url, "--num-prompts", "8", "--concurrency", "4", "--output-len", "15", "--out", str(tmp_path)]
    bench_serving_cli.main(argv)  # every request completes: no exit
    assert capsys.readouterr().err == ""
    fake.fail_every = 2
    with pytest.raises(SystemExit) as exit_info:
        bench_serving_cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1
    assert err.startswith("tllm-spec bench-serve: error: 4 of 8 requests failed") and "429" in err
    assert json.loads((tmp_path / "bench_serving.json").read_text())["summary"]["num_failed"] == 4  # still written
    with pytest.raises(SystemExit) as exit_info:
        bench_serving_cli.main([*argv, "--vocab-size", "32000"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "32000" in err


def test_shared_prefix_prompts_and_the_hit_rate_from_the_usage(url):
    fake.cached = 16  # whole pages of the 20-token prefix
    result = run_benchmark(config(url, dataset="shared-prefix", shared_prefix_len=20, question_len=3))
    prompts = [body["prompt"] for body in fake.bodies]
    assert len(prompts) == 8 and {len(p) for p in prompts} == {23} and len({tuple(p[:20]) for p in prompts}) == 1
    assert len({tuple(p[20:]) for p in prompts}) == 8  # each its own question
    s = result["summary"]
    assert (s["num_prompt_tokens"], s["num_cached_tokens"]) == (8 * 23, 8 * 16)
    assert s["prefix_cache_hit_rate"] == pytest.approx(16 / 23)
    assert all(r["cached_tokens"] == 16 and r["prompt_tokens"] == 23 for r in result["requests"])
    assert format_table([result]).splitlines()[1].split()[6] == "69.6%"  # the hit column


def test_multi_turn_resends_the_conversation_so_far(url):
    result = run_benchmark(config(url, dataset="multi-turn", num_prompts=3, concurrency=2, turns=3, question_len=5))
    requests = result["requests"]
    assert len(requests) == 9 and result["summary"]["num_completed"] == 9
    assert [(r["conversation"], r["turn"]) for r in requests] == [(c, t) for c in range(3) for t in range(3)]
    completion = "ab" * TOKENS_PER_CHUNK * NUM_CHUNKS  # what the fake server streams
    sent = {body["prompt"]: body for body in fake.bodies}
    firsts = [p for p in sent if len(p.split()) == 5]
    assert len(firsts) == 3 and all(p.split()[0].startswith("t") for p in firsts)
    for first in firsts:  # each conversation: every turn starts with the previous one, then its completion
        prompt = first
        for turn in range(1, 3):
            grown = [p for p in sent if p.startswith(f"{prompt} {completion} ") and len(p.split()) == 6 * turn + 5]
            assert len(grown) == 1, (prompt, list(sent))
            prompt = grown[0]
    # a worker runs a conversation's turns back to back: at most 2 conversations, so 2 requests, in flight
    spans = [(r["start"], r["start"] + r["e2e"]) for r in requests]
    assert all(sum(a <= start < b for a, b in spans) <= 2 for start, _ in spans)
    assert max(sum(a <= start < b for a, b in spans) for start, _ in spans) == 2
    assert [r["prompt_tokens"] for r in requests if r["conversation"] == 0] == [5, 11, 17]
