"""SIGINT / SIGTERM with streams in flight: the server drains (503 for new requests), aborts what outlives the
grace period with an error event and [DONE] on every stream, and exits 0 without a traceback."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from .clients import GREEDY, MODEL
from .conftest import server_process

GRACE_S = 3.0
LONG = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 2000, "ignore_eos": True, "stream": True, **GREEDY}


def _stream(url: str, events: list[list[str]]) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60) as response:
        events.append([line for line in response.iter_lines() if line])


def _check_shutdown(sig: int) -> None:
    with server_process("--shutdown-timeout", str(GRACE_S)) as (proc, url, log):
        events: list[list[str]] = []
        threads = [threading.Thread(target=_stream, args=(url, events)) for _ in range(4)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)  # the four streams are running
        signalled = time.monotonic()
        proc.send_signal(sig)
        time.sleep(0.5)
        refused = httpx.post(f"{url}/v1/completions", json={**LONG, "stream": False, "max_tokens": 2}, timeout=10)
        health = httpx.get(f"{url}/health", timeout=10).status_code
        returncode = proc.wait(timeout=GRACE_S + 10)
        exit_after = time.monotonic() - signalled
        for thread in threads:
            thread.join(timeout=10)
        log.seek(0)
        output = log.read().decode(errors="replace")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert health == 503
    assert returncode == 0, output
    assert exit_after < GRACE_S + 5, f"exited {exit_after:.1f} s after the signal"  # no wait for a timeout of its own
    assert "Traceback" not in output and "Event loop is closed" not in output, output
    assert len(events) == 4
    for lines in events:  # text chunks, then the abort as an error event, then [DONE]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "aborted", error
        assert len(lines) > 3  # the stream had sent text before the abort


@pytest.mark.slow  # a real server process drained by SIGINT: fifteen seconds on the 2-core machine
def test_sigint_drains_aborts_and_exits_0():
    _check_shutdown(signal.SIGINT)


@pytest.mark.slow  # a second server process: the same path as SIGINT's
def test_sigterm_drains_aborts_and_exits_0():
    _check_shutdown(signal.SIGTERM)


@pytest.mark.slow  # ten seconds or more on the 2-core CI machine: the second CI command runs it
def test_requests_that_finish_within_the_grace_period_are_answered_in_full():
    with server_process("--shutdown-timeout", "60") as (proc, url, _):
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "max_tokens": 300}, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            proc.send_signal(signal.SIGINT)  # in flight: it may finish
            rest = [line for line in lines if line]
        assert proc.wait(timeout=30) == 0
    chunks = [json.loads(line.removeprefix("data: ")) for line in [first, *rest[:-1]]]
    assert rest[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
