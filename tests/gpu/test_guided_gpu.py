"""Guided decoding inside the CUDA graph: the graphed speculative step under a grammar equals eager plain
constrained decoding, and forced runs are drafted exactly (the draft masks replay with the graph)."""
import json

import pytest
import torch

from tllm_spec import SamplingParams
from tllm_spec.config import GuidedDecodingParams
from tllm_spec.spec_model import SpecModel

from ..guided.test_guided import PROMPTS, SCHEMA
from ..models import eagle3, tiny_guided_pair

pytestmark = pytest.mark.cuda
pytest.importorskip("llguidance")


def _model(spec, eager):
    target, _ = tiny_guided_pair()
    return SpecModel.from_pretrained(target, spec, dtype=torch.float32, device="cuda", max_batch_size=4,
                                     enforce_eager=eager, compile_step=False)


def test_graphed_guided_speculation_equals_eager_plain():
    _, head = tiny_guided_pair()
    params = [SamplingParams(max_new_tokens=80, guided_decoding=GuidedDecodingParams(json_schema=SCHEMA)),
              SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=60, guided_decoding=GuidedDecodingParams(
                  regex=r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"))]
    graphed = _model(eagle3(head, 3), eager=False)
    outs = graphed.generate(PROMPTS, params)
    assert graphed.runner.graph_runner is not None and graphed.runner.graph_runner.graphs, "no CUDA graph was used"
    plain = _model(None, eager=True).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    json.loads(outs[0].text)


def test_graphed_forced_grammar_accepts_every_draft():
    _, head = tiny_guided_pair()
    text = '"speculative decoding keeps the grammar"'
    out = _model(eagle3(head, 3), eager=False).generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=80, guided_decoding=GuidedDecodingParams(
            json_schema={"enum": [json.loads(text)]})))[0]
    assert out.text == text and out.stats.accepted_per_step[:-1] == [4] * (len(out.stats.accepted_per_step) - 1)
