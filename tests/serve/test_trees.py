"""A server drafting a dynamic tree (``--spec-config``), driven by the official openai client: concurrent
streamed and whole completions, greedy and seeded sampled, equal offline ``generate()`` with the same config, and
steps accept whole paths of the tree."""
from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from tllm_spec import Eagle3Config, SpecModel

from .clients import GREEDY, SEEDED, complete, offline_text, scrape
from .conftest import running_server

TREE = {"use_dynamic_tree": True, "dynamic_tree_max_topK": 3, "max_total_draft_tokens": 14, "max_draft_len": 4,
        "use_rejection_sampling": True}
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\nclass ", "    for key, value in ", "class Stack:\n"]


@pytest.fixture(scope="module")
def tree_server() -> Iterator[str]:
    with running_server("--spec-config", json.dumps(TREE)) as url:
        yield url


@pytest.mark.slow  # real processes or compiles: ten seconds or more (the second CI command)
def test_a_tree_server_streams_what_offline_generate_gives(tree_server):
    offline = SpecModel.from_pretrained("demo://target", Eagle3Config(speculative_model="demo://eagle3", **TREE),
                                        dtype=torch.float32, device="cpu", max_batch_size=8)
    jobs = [(prompt, params, stream) for prompt in PROMPTS for params in (GREEDY, SEEDED) for stream in (False, True)]
    with openai.OpenAI(base_url=f"{tree_server}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        with ThreadPoolExecutor(len(jobs)) as pool:  # all at once: they share the server's batch
            results = list(pool.map(lambda job: complete(client, job[0], stream=job[2], max_tokens=32, **job[1]),
                                    jobs))
    for (prompt, params, _), result in zip(jobs, results):
        assert result.text == offline_text(offline, prompt, max_new_tokens=32, **params)
    metrics = scrape(tree_server)
    steps, accepted = (metrics[f"tllm_spec_accepted_tokens_per_step_{s}"] for s in ("count", "sum"))
    assert steps > 0 and accepted / steps > 2  # the tree's paths are accepted, not just its root
    buckets = [name for name in metrics if name.startswith("tllm_spec_accepted_tokens_per_step_bucket")]
    assert len(buckets) == TREE["max_draft_len"] + 2  # 1..depth + 1 tokens a step, and +Inf
