"""The skinny-GEMM custom op: its fake and real kernels agree (torch.library.opcheck, on the CPU reference),
and ``layers.linear`` is the module itself off CUDA."""
import pytest
import torch
from torch import nn

from tllm_spec.layers import _skinny_linear_op, linear


@pytest.mark.parametrize("bias", [False, True])
def test_op_passes_opcheck(bias):
    x, layer = torch.randn(3, 16), nn.Linear(16, 24, bias=bias)
    torch.library.opcheck(_skinny_linear_op, (x, layer.weight.detach(), layer.bias.detach() if bias else None))


def test_linear_is_the_module_on_cpu():
    x, layer = torch.randn(5, 16), nn.Linear(16, 8)
    assert torch.equal(linear(x, layer), layer(x))
