"""Logprobs of the emitted tokens (SamplingParams.logprobs): the target's log_softmax at each token's row, the same
with EAGLE-3 and MTP speculation as without and as HF's own forward; trimmed with the tokens; streamed in pieces
that add up; None for requests that did not ask; through the graph runner's bookkeeping and running ahead."""
from __future__ import annotations

from functools import cache

import pytest
import torch
from transformers import AutoModelForCausalLM

from tllm_spec import Eagle3Config, MTPConfig, SamplingParams, SpecModel
from tllm_spec.config import GuidedDecodingParams
from tllm_spec.demo import resolve
from tllm_spec.engine.request import RequestOutput
from tllm_spec.one_model import packed_columns

from ..models import eagle3, tiny_guided_pair
from .test_run_ahead import count_steps_run_ahead

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\nclass ", "    for key, value in "]
SPEC = {"eagle3": Eagle3Config(speculative_model="demo://eagle3", max_draft_len=3), "mtp": MTPConfig(), "plain": None,
        "static-tree": Eagle3Config(speculative_model="demo://eagle3", max_draft_len=2,
                                    eagle_choices=[[0], [1], [2], [0, 0], [1, 0]], use_rejection_sampling=True),
        "dynamic-tree": Eagle3Config(speculative_model="demo://eagle3", max_draft_len=4, use_dynamic_tree=True,
                                     dynamic_tree_max_topK=3, max_total_draft_tokens=14, use_rejection_sampling=True)}
TOL = 1e-4


@cache
def demo(spec: str) -> SpecModel:
    return SpecModel.from_pretrained("demo://target", SPEC[spec], dtype=torch.float32, device="cpu", max_batch_size=4)


@cache
def hf_demo():
    return AutoModelForCausalLM.from_pretrained(resolve("demo://target"), dtype=torch.float32).eval()


def hf_logprobs(model, out: RequestOutput) -> torch.Tensor:
    """The target's log_softmax at each output token's row (HF forward over prompt + output). [n, V] f32."""
    ids = torch.tensor([out.prompt_token_ids + out.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(out.prompt_token_ids) - 1:-1]
    return torch.log_softmax(logits.float(), -1)


def check_against(reference: torch.Tensor, out: RequestOutput, num_top: int) -> None:
    """out's logprobs and top_logprobs are the reference rows' (one per token), sorted, num_top each."""
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids) == reference.shape[0]
    chosen = reference.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(out.logprobs), chosen, atol=TOL)
    for row, token, value, top in zip(reference, out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == num_top and list(top.values()) == sorted(top.values(), reverse=True)
        assert torch.allclose(torch.tensor(list(top.values())), row.topk(num_top).values, atol=TOL)
        assert set(top) == set(row.topk(num_top).indices.tolist())
        if token in top:
            assert top[token] == value


@pytest.mark.parametrize("spec", ["eagle3", "mtp", pytest.param("static-tree", marks=pytest.mark.slow),  # 3 s
                                  "dynamic-tree"])
def test_greedy_speculative_logprobs_equal_plain_decoding_and_hf(spec):
    """A tree's emitted tokens come from the rows of its accepted path's nodes, not from its first rows."""
    params = SamplingParams(max_new_tokens=40, logprobs=5)
    outs, plain = demo(spec).generate(PROMPTS, params), demo("plain").generate(PROMPTS, params)
    assert outs.stats["mean_accepted_length"] > 1.5  # steps emit several tokens: every column of a step is read
    for out, base in zip(outs, plain):
        assert out.token_ids == base.token_ids
        assert torch.allclose(torch.tensor(out.logprobs), torch.tensor(base.logprobs), atol=TOL)
        assert [list(t) for t in out.top_logprobs] == [list(t) for t in base.top_logprobs]
        check_against(hf_logprobs(hf_demo(), out), out, 5)
        assert all(next(iter(top)) == token for top, token in zip(out.top_logprobs, out.token_ids))  # greedy: top-1


@pytest.mark.parametrize("spec", ["eagle3", "dynamic-tree"])
def test_sampled_requests_get_the_logprob_of_the_sampled_token(spec):
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=7, logprobs=20)
    outs = demo(spec).generate(PROMPTS, params)
    for out in outs:
        check_against(hf_logprobs(hf_demo(), out), out, 20)
    not_top1 = [t for out in outs for t, top in zip(out.token_ids, out.top_logprobs) if next(iter(top)) != t]
    assert not_top1  # sampling chose tokens other than the most likely one: their logprobs were checked too


def test_streamed_logprobs_add_up_to_the_final_ones():
    params = SamplingParams(max_new_tokens=40, logprobs=1)
    outs = list(demo("eagle3").generate_stream(PROMPTS[0], params))
    final = outs[-1].output
    assert all(len(o.logprobs) == len(o.top_logprobs) == len(o.token_ids) for o in outs)
    assert [v for o in outs for v in o.logprobs] == final.logprobs
    assert [t for o in outs for t in o.top_logprobs] == final.top_logprobs
    assert max(len(o.token_ids) for o in outs) > 1  # a step's several tokens went out together


def test_requests_without_logprobs_get_none_beside_those_with():
    params = [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=30, logprobs=2),
              SamplingParams(max_new_tokens=30, temperature=1.0, seed=3), SamplingParams(max_new_tokens=30, logprobs=0)]
    outs = demo("eagle3").generate(PROMPTS + PROMPTS[:1], params)
    assert [o.logprobs is None for o in outs] == [True, False, True, False]
    assert outs[0].top_logprobs is None and outs[2].top_logprobs is None
    check_against(hf_logprobs(hf_demo(), outs[1]), outs[1], 2)
    check_against(hf_logprobs(hf_demo(), outs[3]), outs[3], 0)
    assert all(top == {} for top in outs[3].top_logprobs)


def test_stops_trim_the_logprobs_with_the_tokens():
    model = demo("eagle3")
    full = model.generate([PROMPTS[0]], SamplingParams(max_new_tokens=40, logprobs=3, ignore_eos=True))[0]
    stop = full.text[12:15]
    cuts = {"stop string": SamplingParams(max_new_tokens=40, logprobs=3, ignore_eos=True, stop=(stop,)),
            "stop token": SamplingParams(max_new_tokens=40, logprobs=3, ignore_eos=True,
                                         stop_token_ids=(full.token_ids[9],)),
            "max_new_tokens": SamplingParams(max_new_tokens=7, logprobs=3, ignore_eos=True)}
    for name, params in cuts.items():
        out = model.generate([PROMPTS[0]], params)[0]
        n = len(out.token_ids)
        assert 0 < n < len(full.token_ids) and out.token_ids == full.token_ids[:n], name
        assert out.logprobs == full.logprobs[:n] and out.top_logprobs == full.top_logprobs[:n], name
        streamed = list(model.generate_stream(PROMPTS[0], params))
        assert [v for o in streamed for v in o.logprobs] == out.logprobs, name


@pytest.mark.slow  # six seconds or more on the 2-core machine: the second CI command runs it
def test_graphed_steps_carry_logprobs_and_run_ahead(monkeypatch):
    """The CUDA-graph runner's bookkeeping on the CPU (a replay runs the step eagerly): graphs keyed by the width,
    packed outputs as wide as it asks, steps run ahead, and the logprobs of eager steps."""
    graphed = SpecModel.from_pretrained("demo://target", SPEC["eagle3"], dtype=torch.float32, max_batch_size=4)
    graphed.runner.graph_runner = graphed.runner.new_graph_runner()
    launched = count_steps_run_ahead(monkeypatch)
    params = [SamplingParams(max_new_tokens=40, logprobs=1), SamplingParams(max_new_tokens=25),
              SamplingParams(max_new_tokens=33, logprobs=7, temperature=1.0, seed=5)]
    outs, eager = graphed.generate(PROMPTS, params), demo("eagle3").generate(PROMPTS, params)
    assert launched[0] > 5
    graphs = graphed.runner.graph_runner.graphs
    assert (4, 3, 3, False, True, 20) in graphs and graphs[(4, 3, 3, False, True, 20)][1].shape[1] == \
        packed_columns(3, 20)
    for out, expected in zip(outs, eager):
        assert out.token_ids == expected.token_ids and (out.logprobs is None) == (expected.logprobs is None)
        if out.logprobs is not None:
            assert torch.allclose(torch.tensor(out.logprobs), torch.tensor(expected.logprobs), atol=TOL)
            assert [list(t) for t in out.top_logprobs] == [list(t) for t in expected.top_logprobs]
    plain_params = [p.model_copy(update={"logprobs": None}) for p in params]
    assert [o.token_ids for o in graphed.generate(PROMPTS, plain_params)] == [o.token_ids for o in outs]
    assert {key[5] for key in graphs} == {0, 1, 20}  # each request's own width, and the batches' (widest)


def test_a_grammar_masks_the_distribution_and_ends_the_logprobs_with_the_tokens():
    """Logprobs come from the logits the grammar masked: three digits, then the grammar completes mid-step."""
    pytest.importorskip("llguidance")
    target, head = tiny_guided_pair()
    params = SamplingParams(max_new_tokens=20, logprobs=20,
                            guided_decoding=GuidedDecodingParams(regex="[0-9]{3}"))
    prompts = [[5, 17, 3, 44, 9, 2, 71], [12, 8]]
    spec = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2).generate(prompts, params)
    plain = SpecModel.from_pretrained(target, None, max_batch_size=2).generate(prompts, params)
    digits = set(range(ord("0") - 32, ord("9") - 32 + 1))  # char_tokenizer: printable ASCII from id 0
    for out, base in zip(spec, plain):
        assert out.token_ids == base.token_ids and len(out.token_ids) == len(out.logprobs) == 3
        assert torch.allclose(torch.tensor(out.logprobs), torch.tensor(base.logprobs), atol=TOL)
        for top in out.top_logprobs:
            allowed = {t: v for t, v in top.items() if v > float("-inf")}
            assert set(allowed) == digits  # the other ten of the top 20 are -inf
            assert sum(torch.tensor(list(allowed.values())).exp()) == pytest.approx(1.0, abs=1e-5)
