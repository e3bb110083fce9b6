"""What the serving benchmarks share: a tokenizer for random-weight targets, the OpenAI server over a SpecModel in
this process (uvicorn on a daemon thread), and the load generator ``tllm-spec bench-serve`` in a child process, so
that neither steals the other's interpreter."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from tokenizers import Tokenizer, models, pre_tokenizers

from ..serve.app import build_app
from ..spec_model import SpecModel


def numbered_tokenizer(vocab_size: int):
    """A tokenizer whose token i reads "t<i>" (random targets ship none; the server needs text out): text is its
    tokens joined by spaces, and text prompts split on whitespace, one word a token, so a completion's text
    appended to its prompt tokenizes to the prompt's ids and then the completion's (multi-turn loads)."""
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_in_thread(model: SpecModel, name: str, loop: str = "auto") -> tuple[uvicorn.Server, str]:
    """The app over ``model`` in a uvicorn server on a free port, on a daemon thread (``loop``: uvicorn's event
    loop, "auto" (uvloop where installed), "asyncio" or "uvloop"); (server, its URL) once it answers /health."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(model, name), host="127.0.0.1", port=port, log_level="warning",
                                           loop=loop))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not come up")


def bench_serve_child(url: str, flags: list[str], out: Path) -> dict:
    """``tllm-spec bench-serve --base-url url --out out *flags`` in a child process; its JSON report.
    CalledProcessError when it exits non-zero (a request failed, the load was refused)."""
    cmd = [sys.executable, "-m", "tllm_spec.serve.cli", "bench-serve", "--base-url", url, "--out", str(out), *flags]
    subprocess.run(cmd, check=True)
    return json.loads((out / "bench_serving.json").read_text())
