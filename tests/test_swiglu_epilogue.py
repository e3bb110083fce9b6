"""The SwiGLU product as the gate/up GEMM's epilogue (the path a single request's step takes on the GPU, where
the skinny-GEMM kernel computes it) keeps greedy decoding lossless. The rule is forced on here: on the CPU
``layers.linear`` computes the gated result with the stock ops, so these tests check the fused layers' wiring
(target, EAGLE-3 and MTP layers); the kernel's epilogue is checked against its reference in ``tests/kernels``
and ``tests/gpu``."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tllm_spec import MTPConfig, layers
from tllm_spec.drafts import eagle3 as eagle3_module
from tllm_spec.kernels.skinny_linear import skinny_linear_op
from tllm_spec.spec_model import SpecModel

from .models import eagle3, tiny_pair
from .test_lossless import MAX_NEW, PROMPTS, check_lossless
from .test_mtp_lossless import mtp_target


@pytest.fixture
def gated_calls(monkeypatch):
    """Every MLP takes the gated path; the list records the row counts of the MLPs that asked."""
    calls = []

    def always(x, attn):
        calls.append(x.shape[0])
        return True
    monkeypatch.setattr(layers, "swiglu_in_gemm", always)
    monkeypatch.setattr(eagle3_module, "swiglu_in_gemm", always)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_gated_target_and_eagle3_mlps_are_lossless(arch, gated_calls):
    target, head = tiny_pair(arch)
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=3)
    check_lossless(target, model, PROMPTS[:3], MAX_NEW[:3])
    assert 1 in gated_calls  # the draft passes of one request asked too


def test_gated_mtp_mlps_are_lossless(gated_calls):
    target = mtp_target("llama", "deepseek")
    model = SpecModel.from_pretrained(target, MTPConfig(num_nextn_predict_layers=1, max_draft_len=3),
                                      max_batch_size=2)
    check_lossless(target, model, PROMPTS[:2], MAX_NEW[:2])
    assert gated_calls


def test_the_rule_gates_only_single_request_steps_in_half_precision_on_cuda():
    def tensor(rows, dtype=torch.bfloat16, cuda=True):  # the rule reads only these attributes
        return SimpleNamespace(is_cuda=cuda, dtype=dtype, shape=(rows, 4096))

    def meta(tokens_per_request):
        return SimpleNamespace(tokens_per_request=tokens_per_request)
    assert layers.swiglu_in_gemm(tensor(4), meta(4))  # one request's verify rows
    assert layers.swiglu_in_gemm(tensor(1, torch.float16), meta(1))  # one request's draft pass
    assert not layers.swiglu_in_gemm(tensor(8), meta(4))  # two requests
    assert not layers.swiglu_in_gemm(tensor(2), meta(1))
    assert not layers.swiglu_in_gemm(tensor(4, torch.float32), meta(4))  # fp32 keeps the stock ops
    assert not layers.swiglu_in_gemm(tensor(4, cuda=False), meta(4))
    assert not layers.swiglu_in_gemm(tensor(17), meta(17))  # more rows than the kernel takes


@pytest.mark.parametrize("bias", [False, True])
def test_gated_op_passes_opcheck(bias):
    x, layer = torch.randn(3, 16), nn.Linear(16, 24, bias=bias)
    torch.library.opcheck(skinny_linear_op, (x, layer.weight.detach(), layer.bias.detach() if bias else None, True))


def test_gated_linear_is_the_stock_swiglu_on_cpu():
    x, layer = torch.randn(5, 16), nn.Linear(16, 24)
    gate, up = layer(x).split(12, dim=-1)
    assert torch.equal(layers.linear(x, layer, gated=True), torch.nn.functional.silu(gate) * up)
