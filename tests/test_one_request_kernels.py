"""The one-request path (RMSNorms as their own op, residual adds and the SwiGLU product as GEMM epilogues: what a
single request's step runs on the GPU) keeps greedy decoding lossless. The rule is forced on here: on the CPU
``layers.linear`` and the norm op compute the same results with the stock ops, so these tests check the fused
layers' wiring (target, EAGLE-3 and MTP layers: which residual is added where, which norm feeds which GEMM);
the kernels are checked against their references in ``tests/kernels`` and ``tests/gpu``."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tllm_spec import MTPConfig, layers
from tllm_spec.drafts import eagle3 as eagle3_module
from tllm_spec.kernels.rms_norm import rms_norm_op
from tllm_spec.kernels.skinny_linear import skinny_linear_op
from tllm_spec.spec_model import SpecModel

from .models import eagle3, tiny_pair
from .test_lossless import MAX_NEW, PROMPTS, check_lossless
from .test_mtp_lossless import mtp_target


@pytest.fixture
def forced_rule(monkeypatch):
    """Every layer takes the one-request path; the list records the row counts of the layers that asked."""
    calls = []

    def always(x, attn):
        calls.append(x.shape[0])
        return True
    monkeypatch.setattr(layers, "one_request_kernels", always)
    monkeypatch.setattr(eagle3_module, "one_request_kernels", always)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_target_and_eagle3_layers_are_lossless(arch, forced_rule):
    target, head = tiny_pair(arch)
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=3)
    check_lossless(target, model, PROMPTS[:3], MAX_NEW[:3])
    assert 1 in forced_rule  # the draft passes of one request asked too


def test_mtp_layers_are_lossless(forced_rule):
    target = mtp_target("llama", "deepseek")
    model = SpecModel.from_pretrained(target, MTPConfig(num_nextn_predict_layers=1, max_draft_len=3),
                                      max_batch_size=2)
    check_lossless(target, model, PROMPTS[:2], MAX_NEW[:2])
    assert forced_rule


def test_the_rule_takes_only_single_request_steps_in_half_precision_on_cuda():
    def tensor(rows, dtype=torch.bfloat16, cuda=True):  # the rule reads only these attributes
        return SimpleNamespace(is_cuda=cuda, dtype=dtype, shape=(rows, 4096))

    def meta(tokens_per_request):
        return SimpleNamespace(tokens_per_request=tokens_per_request)
    assert layers.one_request_kernels(tensor(4), meta(4))  # one request's verify rows
    assert layers.one_request_kernels(tensor(1, torch.float16), meta(1))  # one request's draft pass
    assert not layers.one_request_kernels(tensor(8), meta(4))  # two requests
    assert not layers.one_request_kernels(tensor(2), meta(1))
    assert not layers.one_request_kernels(tensor(4, torch.float32), meta(4))  # fp32 keeps the stock ops
    assert not layers.one_request_kernels(tensor(4, cuda=False), meta(4))
    assert not layers.one_request_kernels(tensor(17), meta(17))  # more rows than the kernel takes


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_op_with_epilogues_passes_opcheck(bias, gated, residual):
    x, layer = torch.randn(3, 16), nn.Linear(16, 24, bias=bias)
    res = torch.randn(3, 12 if gated else 24) if residual else None
    torch.library.opcheck(skinny_linear_op, (x, layer.weight.detach(), layer.bias.detach() if bias else None,
                                             gated, res))


def test_norm_op_passes_opcheck():
    torch.library.opcheck(rms_norm_op, (torch.randn(3, 16), torch.rand(16) + 0.5, 1e-6))


def test_linear_and_norm_are_the_stock_ops_on_cpu():
    x, layer, residual = torch.randn(5, 16), nn.Linear(16, 24), torch.randn(5, 12)
    gate, up = layer(x).split(12, dim=-1)
    assert torch.equal(layers.linear(x, layer, gated=True, residual=residual),
                       residual + torch.nn.functional.silu(gate) * up)
    stock = LlamaRMSNorm(16, eps=1e-6)
    nn.init.normal_(stock.weight)
    for dtype in (torch.float32, torch.bfloat16):
        h = torch.randn(5, 16).to(dtype)
        assert torch.equal(layers.norm(h, stock.to(dtype)), stock.to(dtype)(h))
