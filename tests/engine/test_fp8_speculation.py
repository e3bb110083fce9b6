"""Speculation over an FP8 target stays lossless: on the demo target quantized at load (``quantization="fp8"``), the
EAGLE-3 head, the MTP module and suffix drafting each emit exactly the tokens the target picks in the rows that
verify them, and decode greedily what the FP8 target decodes alone, up to FP8 rounding; they accept drafts.
``draft_quantization="fp8"`` quantizes the draft's own layers (an EAGLE-3 head's fc and midlayer, an MTP module's
projections; not the lm_head) and changes nothing of that; without a draft it is refused.

Why "up to FP8 rounding": a step of K + 1 rows and a step of one row round their float sums differently (1e-6; the
CPU's GEMM picks its kernel by row count), which flips an activation's FP8 rounding now and then, and a flipped
rounding moves the next layers' activations across further boundaries: the FP8 target's logprobs then differ by up to
~0.2 nats between the two runs (its plain greedy output even changes with max_batch_size). So the outputs agree
token for token until a position where the FP8 target's two best tokens lie within that noise of each other."""
from __future__ import annotations

from functools import cache

import pytest
from torch import nn

from tllm_spec import Eagle3Config, GenerationOutputs, MTPConfig, SAConfig, SamplingParams, SpecModel
from tllm_spec.kernels.fp8_linear import MAX_ROWS as FP8_MAX_ROWS
from tllm_spec.kernels.skinny_linear import MAX_ROWS
from tllm_spec.model import layers
from tllm_spec.model.quant.linear import Fp8Linear

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\nclass ", "    for key, value in "]
MAX_NEW = 24
SPECS = {"eagle3": Eagle3Config(speculative_model="demo://eagle3", max_draft_len=3),
         "mtp": MTPConfig(num_nextn_predict_layers=1, max_draft_len=2),
         "sa": SAConfig(max_draft_len=4)}


def demo(spec: str | None, draft_quantization: str | None = None) -> SpecModel:
    return SpecModel.from_pretrained("demo://target", SPECS[spec] if spec else None, dtype="float32", device="cpu",
                                     quantization="fp8", draft_quantization=draft_quantization, max_batch_size=3)


FP8_NOISE = 0.5  # nats: twice the largest logprob difference seen between the two runs (0.225, 8 prompts x 48)


@cache
def fp8_plain() -> GenerationOutputs:
    """The FP8 demo target's own greedy continuations of PROMPTS, with each token's logprob and the best two."""
    with demo(None) as model:
        assert isinstance(model.target.hf.model.layers[0].mlp.down_proj, Fp8Linear)
        return model.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, logprobs=2))


def check_lossless(model: SpecModel) -> None:
    outs = model.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, logprobs=2))
    assert_agrees_up_to_near_ties(outs, fp8_plain(), FP8_NOISE, min_agreed=len(PROMPTS) * MAX_NEW / 2)


def assert_agrees_up_to_near_ties(outs: GenerationOutputs, plain: GenerationOutputs, noise: float,
                                  min_agreed: float) -> None:
    """Speculative greedy ``outs`` against the same target's own ``plain`` greedy outputs (both with logprobs=2):
    every emitted token is the argmax of the row that verified it; the two agree token for token (logprobs within
    ``noise`` nats) until a position where the target alone hesitates between two tokens closer than ``noise``;
    at least ``min_agreed`` tokens agree over all requests, and some step accepted a draft."""
    agreed = 0
    for out, alone in zip(outs, plain, strict=True):
        # accept while draft == target: every emitted token is the argmax of the row that verified it
        assert all(token == max(top, key=top.get) for token, top in zip(out.token_ids, out.top_logprobs))
        length = len(alone.token_ids)
        n = next((i for i, (a, b) in enumerate(zip(out.token_ids, alone.token_ids)) if a != b), length)
        assert max((abs(a - b) for a, b in zip(out.logprobs[:n], alone.logprobs[:n])), default=0.0) < noise
        if n < length:  # the first difference: where the target alone hesitates between two tokens
            best, second = sorted(alone.top_logprobs[n].values(), reverse=True)
            assert best - second < noise, (n, alone.top_logprobs[n])
        agreed += n
    assert agreed >= min_agreed
    assert sum(outs.stats["histogram"][1:]) > 0  # some step accepted a draft


@pytest.mark.parametrize("spec", [pytest.param("eagle3", marks=pytest.mark.slow), "mtp", "sa"])  # EAGLE-3: 4 s
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


def test_the_few_row_path_over_an_fp8_target_is_lossless(monkeypatch):
    """The path a GPU decoding step of up to 64 rows takes in blocks of FP8 projections, forced on (on the CPU its
    ops are their references): the norms write FP8 rows and their scales, the q|k|v projection rotates q and k, the
    gate/up projection multiplies, o and down add the residual; speculation stays lossless as above."""
    fp8_plain()  # the FP8 target alone on the stock path, before the rule is forced
    bounds = []

    def forced(x, attn, max_rows=MAX_ROWS):
        bounds.append(max_rows)
        return True
    monkeypatch.setattr(layers, "few_row_kernels", forced)
    with demo("mtp") as model:
        check_lossless(model)
    assert FP8_MAX_ROWS in bounds  # the target's FP8 blocks asked with the FP8 kernel's bound
