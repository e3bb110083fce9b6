"""Draft trees on the GPU, graphed (buckets captured, steps run ahead; eager kernels captured, sparing each test a
torch.compile: tests/engine/test_step_graph.py traces the tree steps) and eager: greedy output equals plain decoding,
and seeded sampled requests (rejection sampling) equal eager's.
"""
import pytest
import torch

from tllm_spec import Eagle3Config, SamplingParams
from tllm_spec.spec_model import SpecModel

from ..engine.test_run_ahead import count_steps_run_ahead

pytestmark = pytest.mark.cuda
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\nclass ", "    for key, value in ", "class Stack:\n", "x = ["]
TREES = {"static": dict(max_draft_len=4, eagle_choices=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0],
                                                         [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0]]),
         "dynamic": dict(max_draft_len=6, use_dynamic_tree=True, dynamic_tree_max_topK=4,
                         max_total_draft_tokens=24)}


def _model(tree: str | None, eager: bool, dtype=torch.float32) -> SpecModel:
    spec = None if tree is None else Eagle3Config(speculative_model="demo://eagle3", use_rejection_sampling=True,
                                                  **TREES[tree])
    return SpecModel.from_pretrained("demo://target", spec, dtype=dtype, device="cuda", max_batch_size=4,
                                     enforce_eager=eager, compile_step=False)


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_graphed_greedy_tree_equals_plain_decoding(tree, monkeypatch):
    params = SamplingParams(max_new_tokens=48)
    plain = _model(None, eager=True).generate(PROMPTS, params)
    model = _model(tree, eager=False)
    launched = count_steps_run_ahead(monkeypatch)
    outs = model.generate(PROMPTS, params)  # five prompts for four slots: the fifth joins beside the graph
    assert model.runner.graph_runner.graphs and launched[0] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert outs.stats["mean_accepted_length"] > 3


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_graphed_sampled_tree_equals_eager(tree):
    params = [SamplingParams(max_new_tokens=32, temperature=0.0 if i % 2 else 0.9, seed=None if i % 2 else 70 + i)
              for i in range(len(PROMPTS))]
    graphed, eager = _model(tree, eager=False), _model(tree, eager=True)
    ahead, expected = graphed.generate(PROMPTS, params), eager.generate(PROMPTS, params)
    assert [(o.token_ids, o.stats) for o in ahead] == [(o.token_ids, o.stats) for o in expected]


def test_a_tree_step_in_bf16_runs_and_accepts():
    outs = _model("dynamic", eager=False, dtype=torch.bfloat16).generate(
        PROMPTS, SamplingParams(max_new_tokens=32, ignore_eos=True))
    assert outs.stats["mean_accepted_length"] > 3 and all(len(o.token_ids) == 32 for o in outs)
