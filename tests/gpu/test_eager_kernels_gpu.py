"""The eager steps' one-pass kernels on the GPU (a prompt's rows): the stock ops' results to the bit."""
import pytest
import torch

from tllm_spec.kernels.rotary import rotary, rotary_ref
from tllm_spec.kernels.silu_mul import silu_mul, silu_mul_ref

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # fp16: the reference
@pytest.mark.parametrize("tokens", [1, 7, 4099])
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((16, 2), 64)])
def test_rotary_kernel_is_the_stock_rotation(dtype, tokens, heads, head_dim):
    num_heads, num_kv_heads = heads
    g = torch.Generator(device="cuda").manual_seed(tokens + num_heads)
    qkv = torch.randn(tokens, num_heads + 2 * num_kv_heads, head_dim, device="cuda", generator=g).to(dtype)
    qk = qkv[:, :num_heads + num_kv_heads]  # a strided slice, as the attention passes it
    angles = torch.randn(tokens, 1, head_dim // 2, device="cuda", generator=g).repeat(1, 1, 2) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    assert torch.equal(rotary(qk, cos, sin), rotary_ref(qk, cos, sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 4099])
@pytest.mark.parametrize("width", [14336, 1000])
def test_silu_mul_kernel_matches_the_stock_ops(dtype, rows, width):
    g = torch.Generator(device="cuda").manual_seed(rows + width)
    x = (3 * torch.randn(rows, 2 * width, device="cuda", generator=g)).to(dtype)
    assert torch.equal(silu_mul(x), silu_mul_ref(x))
