"""The tensor-parallel step compiled whole, on the CPU: gloo at world size 2, the step traced by Dynamo with the
collectives inside it (the layers' all-reduces, the sharded head's all-reduces and vocabulary gather, the broadcast
of the packed outputs) and run through AOT autograd, as Inductor sees it. What a GPU then compiles and captures
(tests/gpu/test_tensor_parallel_gpu.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tllm_spec import SamplingParams, trace_cache
from tllm_spec.engine.cuda_graphs import compiled_generation_step, generation_step, step_compile_settings
from tllm_spec.spec_model import SpecModel

from ..engine.test_step_graph import breaks_elsewhere
from ..models import eagle3
from .test_tensor_parallel import WORLD_SIZE, run_ranks, tiny_tp_pair

BATCH, K = 3, 3


def _compiled_and_eager_steps(target: str, head: str, tp_draft: str, temperature: float) -> dict:
    os.environ[trace_cache.TRACE_CACHE_VAR] = "0"
    torch.manual_seed(0)  # the same random inputs on both ranks (lockstep)
    spec = eagle3(Path(head), K).model_copy(update={"use_rejection_sampling": temperature > 0})
    model = SpecModel.from_pretrained(target, spec, max_batch_size=BATCH, tensor_parallel_size=WORLD_SIZE,
                                      tp_draft=tp_draft, dtype=torch.float32)
    metadata, modules = model.runner.spec_metadata, (model.runner.model, model.runner.kv_cache)
    metadata.prepare([SamplingParams(temperature=temperature, top_k=20, seed=7)] * BATCH, (), K, K)
    ids = torch.randint(0, 90, (BATCH * (K + 1),))
    positions = torch.arange(K + 1).repeat(BATCH) + 6
    slots = torch.arange(BATCH).repeat_interleave(K + 1)
    drafts = torch.randint(0, 90, (BATCH, K))
    args = (*modules, ids, positions, slots, drafts)

    def run(step) -> torch.Tensor:
        metadata.reseed(0)  # the sampled rows draw the same numbers each time
        with torch.inference_mode(), step_compile_settings(cache_traces=False):
            return step(*args)

    with torch.inference_mode():
        explained = torch._dynamo.explain(generation_step)(*args)
    torch._dynamo.reset()
    eager = run(generation_step)
    compiled = run(compiled_generation_step(backend="aot_eager", cache_traces=False))
    return {"breaks elsewhere": breaks_elsewhere(b.reason for b in explained.break_reasons),
            "equal": torch.equal(compiled, eager), "packed": eager.tolist()}


@pytest.mark.slow  # two processes compiling the step twice over: tens of seconds on the 2-core machine
@pytest.mark.parametrize("tp_draft, temperature", [("replicated", 0.0), ("sharded", 0.8)])
def test_tp2_step_compiles_whole_to_the_eager_outputs(tp_draft, temperature):
    """The TP-2 step traces with no graph break but the layer stack's, and compiled it packs the eager step's
    outputs on every rank (greedy with the replicated head; sampled with rejection and the sharded head)."""
    target, head = tiny_tp_pair("llama")
    ranks = run_ranks(_compiled_and_eager_steps, str(target), str(head), tp_draft, temperature)
    for answer in ranks:
        assert not (isinstance(answer, tuple) and answer[0] == "error"), answer[1]
    for answer in ranks:
        assert answer["breaks elsewhere"] == [] and answer["equal"]
    assert ranks[0]["packed"] == ranks[1]["packed"]  # lockstep
