"""SpecModel.warmup: the sampling variants it prepares, and a model that still decodes the same afterwards."""
import torch

from tllm_spec import SamplingParams, SpecModel
from tllm_spec.drafts.metadata import sampling_variant
from tllm_spec.engine.cuda_graphs import variant_example
from tllm_spec.spec_model import WARMUP_VARIANTS


def test_warmup_variants_are_greedy_sampled_and_seeded():
    assert {sampling_variant([variant_example(v)]) for v in WARMUP_VARIANTS} == {
        (True, False, 0), (False, False, 0), (False, True, 0)}


def test_warmup_asks_the_runner_for_every_variant_and_changes_no_output(monkeypatch):
    model = SpecModel.from_pretrained("demo://target", None, dtype=torch.float32, device="cpu", max_batch_size=2)
    before = model.generate(["def f(x):"], SamplingParams(max_new_tokens=8))[0].token_ids
    asked = []
    monkeypatch.setattr(model.runner, "prepare_graphs", lambda params: asked.extend(params))
    assert model.warmup(logprobs=[0, 7]) == 0  # no CUDA graphs on the CPU
    assert {sampling_variant([p]) for p in asked} == set(WARMUP_VARIANTS) | {(True, False, 1), (True, False, 20)}
    monkeypatch.undo()
    assert model.generate(["def f(x):"], SamplingParams(max_new_tokens=8))[0].token_ids == before
