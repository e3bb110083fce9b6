"""Speculation over an FP8 target stays lossless: on the demo target quantized at load (``quantization="fp8"``), the
EAGLE-3 head, the MTP module and suffix drafting each decode greedily exactly what the FP8 target decodes alone, and
accept drafts. ``draft_quantization="fp8"`` quantizes the draft's own layers (an EAGLE-3 head's fc and midlayer, an
MTP module's projections; not the lm_head) and changes nothing of the output; without a draft it is refused."""
from __future__ import annotations

from functools import cache

import pytest
from torch import nn

from tllm_spec import Eagle3Config, MTPConfig, SAConfig, SamplingParams, SpecModel
from tllm_spec.model.quant.linear import Fp8Linear

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\nclass ", "    for key, value in "]
MAX_NEW = 24
SPECS = {"eagle3": Eagle3Config(speculative_model="demo://eagle3", max_draft_len=3),
         "mtp": MTPConfig(num_nextn_predict_layers=1, max_draft_len=2),
         "sa": SAConfig(max_draft_len=4)}


def demo(spec: str | None, draft_quantization: str | None = None) -> SpecModel:
    return SpecModel.from_pretrained("demo://target", SPECS[spec] if spec else None, dtype="float32", device="cpu",
                                     quantization="fp8", draft_quantization=draft_quantization, max_batch_size=3)


@cache
def fp8_greedy() -> tuple[list[int], ...]:
    """The FP8 demo target's own greedy continuations of PROMPTS."""
    with demo(None) as model:
        assert isinstance(model.target.hf.model.layers[0].mlp.down_proj, Fp8Linear)
        return tuple(out.token_ids for out in model.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW)))


def check_lossless(model: SpecModel) -> None:
    outs = model.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))
    assert tuple(out.token_ids for out in outs) == fp8_greedy()
    assert sum(outs.stats["histogram"][1:]) > 0  # some step accepted a draft


@pytest.mark.parametrize("spec", list(SPECS))
def test_speculation_over_an_fp8_target_is_lossless(spec):
    with demo(spec) as model:
        check_lossless(model)


@pytest.mark.parametrize("spec", ["eagle3", "mtp"])
def test_an_fp8_draft_keeps_its_lm_head_and_the_output(spec):
    with demo(spec, draft_quantization="fp8") as model:
        draft = model.worker.draft_model
        linears = {name: m for name, m in draft.named_modules() if isinstance(m, nn.Linear)}
        assert type(linears.pop("lm_head")) is nn.Linear
        assert linears and all(isinstance(m, Fp8Linear) for m in linears.values()), linears
        if spec == "eagle3":  # the fc over the three captured layers and the midlayer's projections
            assert "fc" in linears and any(name.startswith("midlayer.") for name in linears)
        check_lossless(model)


def test_draft_quantization_without_a_draft_is_refused():
    with pytest.raises(ValueError, match="draft_quantization is given but there is no draft"):
        demo(None, draft_quantization="fp8")
