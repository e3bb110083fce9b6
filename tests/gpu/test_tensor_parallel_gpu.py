"""Tensor parallelism on 2 GPUs (NCCL): compiled, CUDA-graphed steps with the collectives inside the graph.
Skipped unless 2 GPUs are visible."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tllm_spec import SamplingParams
from tllm_spec.spec_model import SpecModel

from ..distributed.test_tensor_parallel import MAX_NEW, PROMPTS, WORLD_SIZE, run_ranks, tiny_tp_pair
from ..models import eagle3, hf_greedy

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(torch.cuda.device_count() < WORLD_SIZE,
                                                    reason=f"needs {WORLD_SIZE} GPUs")]


def _greedy(target: str, head: str | None, dtype: torch.dtype, tensor_parallel_size: int) -> dict:
    spec = eagle3(Path(head), 3) if head else None
    model = SpecModel.from_pretrained(target, spec, dtype=dtype, device="cuda", max_batch_size=4,
                                      tensor_parallel_size=tensor_parallel_size)
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    return {"tokens": [o.token_ids for o in outs], "graphs": len(model.runner.graph_runner.graphs)}


@pytest.mark.compiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("speculative", [True, False])
def test_tp2_graphed_greedy_equals_tp1(dtype, speculative):
    target, head = tiny_tp_pair("llama")
    head = str(head) if speculative else None
    ranks = run_ranks(_greedy, str(target), head, dtype, WORLD_SIZE, backend="nccl")
    for answer in ranks:
        assert isinstance(answer, dict), answer
    assert ranks[0] == ranks[1] and ranks[0]["graphs"] > 0  # steps replayed CUDA graphs with NCCL inside
    tp1 = _greedy(str(target), head, dtype, 1)
    assert ranks[0]["tokens"] == tp1["tokens"]
    if dtype == torch.float32:
        assert tp1["tokens"] == [hf_greedy(target, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
