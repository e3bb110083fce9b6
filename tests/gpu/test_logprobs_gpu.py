"""Logprobs on the GPU's default path (the step compiled whole, replayed as CUDA graphs, FlashInfer's samplers, steps
run ahead): the eager step's logprobs, graphs keyed by the logprobs width, no graph break; and in graphs of eager
kernels, the target's own (HF) in fp32."""
from functools import cache

import pytest
import torch
from transformers import AutoModelForCausalLM

from tllm_spec import Eagle3Config, MTPConfig, SamplingParams, SpecModel, trace_cache
from tllm_spec.demo import resolve
from tllm_spec.one_model import packed_columns

from ..engine.test_run_ahead import count_steps_run_ahead
from ..engine.test_step_graph import breaks_elsewhere

pytestmark = pytest.mark.cuda
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\nclass ", "    for key, value in ", "# 日本語 — é\n"]
SPEC = {"eagle3": Eagle3Config(speculative_model="demo://eagle3", max_draft_len=3), "mtp": MTPConfig(), "none": None}
PARAMS = [SamplingParams(max_new_tokens=40, logprobs=1), SamplingParams(max_new_tokens=25),
          SamplingParams(max_new_tokens=33, logprobs=7, temperature=1.0, seed=5),
          SamplingParams(max_new_tokens=30, logprobs=0, temperature=0.8, top_k=20, seed=9)]


def _model(spec: str, dtype: torch.dtype, eager: bool, compile_step: bool = True) -> SpecModel:
    return SpecModel.from_pretrained("demo://target", SPEC[spec], dtype=dtype, device="cuda", max_batch_size=8,
                                     enforce_eager=eager, compile_step=compile_step)


@cache
def _hf_demo():
    return AutoModelForCausalLM.from_pretrained(resolve("demo://target"), dtype=torch.float32).cuda().eval()


def _hf_logprobs(out) -> torch.Tensor:
    """The target's log_softmax at each output token's row (HF forward over prompt + output). [n, V] f32."""
    model = _hf_demo()
    ids = torch.tensor([out.prompt_token_ids + out.token_ids], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(out.prompt_token_ids) - 1:-1]
    return torch.log_softmax(logits.float(), -1).cpu()


@pytest.mark.compiles
# the default (EAGLE-3 in bf16), and in fp32 with tokens exact; each case compiles its own step (K = 0's layout
# compiled: tests/engine/test_step_graph.py, on the CPU)
@pytest.mark.parametrize("spec,dtype", [("eagle3", torch.bfloat16), ("eagle3", torch.float32)])
def test_graphed_compiled_logprobs_equal_eager(spec, dtype, monkeypatch):
    monkeypatch.setenv(trace_cache.TRACE_CACHE_VAR, "0")  # traced here, not loaded from an earlier test's traces
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    graphed, eager = _model(spec, dtype, eager=False), _model(spec, dtype, eager=True)
    launched = count_steps_run_ahead(monkeypatch)
    outs, expected = graphed.generate(PROMPTS, PARAMS, seed=1), eager.generate(PROMPTS, PARAMS, seed=1)
    assert launched[0] > 0 and not breaks_elsewhere(counters["graph_break"]), dict(counters["graph_break"])
    graphs = graphed.runner.graph_runner.graphs
    assert {0, 1, 20} <= {key[5] for key in graphs}
    assert all(packed.shape[1] == packed_columns(graphed.max_draft_len, key[5]) for key, (_, packed) in graphs.items())
    fp32 = dtype == torch.float32
    for out, ref, params in zip(outs, expected, PARAMS):
        assert out.token_ids == ref.token_ids or not fp32  # bf16: compiled and eager kernels may round apart
        assert (out.logprobs is None) == (params.logprobs is None)
        if out.logprobs is None:
            continue
        assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids)
        assert all(len(top) == params.logprobs for top in out.top_logprobs)
        same = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref.token_ids)) if a != b), len(out.token_ids))
        assert same > 0 and torch.allclose(torch.tensor(out.logprobs[:same]), torch.tensor(ref.logprobs[:same]),
                                           atol=1e-4 if fp32 else 5e-2)
    torch._dynamo.reset()


@pytest.mark.parametrize("spec", ["eagle3", "mtp"])
def test_graphed_greedy_logprobs_equal_hf_fp32(spec):
    params = SamplingParams(max_new_tokens=40, logprobs=5)
    outs = _model(spec, torch.float32, eager=False, compile_step=False).generate(PROMPTS[:3], params)
    assert outs.stats["mean_accepted_length"] > 1.5
    for out in outs:
        reference = _hf_logprobs(out)
        chosen = reference.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(out.logprobs), chosen, atol=1e-4)
        for row, top in zip(reference, out.top_logprobs):
            assert len(top) == 5 and torch.allclose(torch.tensor(list(top.values())), row.topk(5).values, atol=1e-4)
