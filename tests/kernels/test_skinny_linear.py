"""The skinny-GEMM custom op: its fake and real implementations agree (torch.library.opcheck, on the CPU
reference) for 2-D and batched inputs, and ``layers.linear`` is the module itself off CUDA. (The kernel itself
is checked under Triton's interpreter in ``interpreted.py`` and on the GPU in ``tests/gpu``.)"""
import pytest
import torch
from torch import nn

from tllm_spec.kernels.skinny_linear import skinny_linear_op
from tllm_spec.model.layers import linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(3, 16), (2, 3, 16)])
def test_op_passes_opcheck(bias, shape):
    x, layer = torch.randn(*shape), nn.Linear(16, 24, bias=bias)
    torch.library.opcheck(skinny_linear_op, (x, layer.weight.detach(), layer.bias.detach() if bias else None))


def test_rotary_op_passes_opcheck():
    x, weight = torch.randn(3, 16), torch.randn(48, 16)  # q|k|v of 8-wide heads: 3 q, 1 k, 1 v (+1 spare row)
    cos, sin = torch.randn(2, 3, 8).unbind(0)
    torch.library.opcheck(skinny_linear_op, (x, weight, None), dict(rope_cos=cos, rope_sin=sin, rotary_cols=32))


def test_linear_is_the_module_on_cpu():
    x, layer = torch.randn(5, 16), nn.Linear(16, 8)
    assert torch.equal(linear(x, layer), layer(x))
