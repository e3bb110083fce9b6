"""Real server processes (``python -m tllm_spec.serve.cli serve``) on free loopback ports, and the same demo pair
loaded in the test process as the oracle (float32, CPU)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tllm_spec import Eagle3Config, SpecModel

from .clients import API_KEY, MODEL

# prefix caching named although it is serve's default: test_prefix_cache.py relies on it, and the other tests'
# outputs, compared with the offline engine's (prefix caching off on the CPU), check that a cache hit changes nothing
SERVER_ARGS = ["--max-batch-size", "8", "--dtype", "float32", "--device", "cpu", "--log-level", "warning",
               "--enable-prefix-caching"]
STARTUP_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(*extra_args: str) -> Iterator[str]:
    """Start a server, wait (bounded) for /health, yield its base URL; stop it however the tests end."""
    with server_process(*extra_args) as (_, url, _):
        yield url


@contextmanager
def server_process(*extra_args: str, launcher: tuple[str, ...] = ("tllm_spec.serve.cli",)
                   ) -> Iterator[tuple[subprocess.Popen, str, object]]:
    """(the server's process, its base URL, its log file: stdout and stderr) once it answers /health. ``launcher``:
    the module (and its arguments before ``serve``) run with ``python -m``, from the repository's root."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two processes share the CPU cores
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", *launcher, "serve", "--port", str(port), *SERVER_ARGS,
                                 *extra_args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=Path(__file__).parents[2])
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_for_health(proc, url, log)
            yield proc, url, log
        finally:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_for_health(proc: subprocess.Popen, url: str, log) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read().decode(errors='replace')}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"the server did not answer /health within {STARTUP_TIMEOUT_S} s")


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    with running_server() as url:
        yield url


@pytest.fixture(scope="session")
def keyed_server_url() -> Iterator[str]:
    """A server that wants API_KEY and admits one request at a time."""
    with running_server("--api-key", API_KEY, "--max-queue", "1") as url:
        yield url


@pytest.fixture
def client(server_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def offline() -> SpecModel:
    return SpecModel.from_pretrained("demo://target", Eagle3Config(speculative_model="demo://eagle3", max_draft_len=3),
                                     dtype=torch.float32, device="cpu", max_batch_size=8)


@pytest.fixture(scope="module")
def demo_app():
    """The demo pair (EAGLE-3 head, K = 3) behind the app, in this process (tests/serve/inprocess.py)."""
    model = SpecModel.from_pretrained("demo://target", Eagle3Config(speculative_model="demo://eagle3", max_draft_len=3),
                                      dtype=torch.float32, device="cpu", max_batch_size=4)
    from tllm_spec.serve.app import build_app
    yield model, build_app(model, MODEL)
    model.close()
