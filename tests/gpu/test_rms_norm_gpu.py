"""The RMSNorm kernels on the GPU (a decoding step's rows and a prompt's; the q/k norms with RoPE after them): the
stock module's ops to the last bit but where summation order tips a rounding."""
import pytest
import torch

from tllm_spec.kernels.qk_norm_rotary import qk_norm_rotary, qk_norm_rotary_ref, supports
from tllm_spec.kernels.rms_norm import rms_norm, rms_norm_ref

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 4, 16, 4099])  # a step's rows, a prompt's
@pytest.mark.parametrize("width", [4096, 5120, 1000])
def test_rms_norm_kernel_matches_the_stock_ops(dtype, rows, width):
    g = torch.Generator(device="cuda").manual_seed(rows + width)
    x = (3 * torch.randn(rows, width, device="cuda", generator=g)).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, device="cuda", generator=g)).to(dtype)
    out = rms_norm(x, weight, 1e-5)
    stock = rms_norm_ref(x, weight, 1e-5)
    # the stock ops' bits but where the mean square's summation order tips the rounding of the normalised value:
    # one ulp there, which the product with the weight (rounded again) can carry to two (seen at 4099 x 5120 bf16)
    torch.testing.assert_close(out.float(), stock.float(), atol=0, rtol=2 ** -6)
    assert (out != stock).float().mean() < 0.01


@pytest.mark.parametrize("rows", [1, 4, 26])
@pytest.mark.parametrize("heads,width", [((32, 4), 128), ((48, 4), 64)])  # Qwen3-30B-A3B; GLM-4.5 at TP 2
def test_qk_norm_rotary_kernel_matches_the_stock_ops(rows, heads, width):
    num_heads, num_kv_heads = heads
    g = torch.Generator(device="cuda").manual_seed(rows + width)
    qkv = (3 * torch.randn(rows, (num_heads + 2 * num_kv_heads) * 128, device="cuda", generator=g)).bfloat16()
    q_weight, k_weight = (1 + 0.2 * torch.randn(2, 128, device="cuda", generator=g)).bfloat16().unbind(0)
    angles = torch.rand(rows, 1, device="cuda", generator=g) * 1000 * torch.rand(width, device="cuda", generator=g)
    cos, sin = torch.cos(angles).bfloat16(), torch.sin(angles).bfloat16()
    args = (qkv, q_weight, k_weight, 1e-6, cos, sin, num_heads, num_kv_heads)
    assert supports(qkv, q_weight, k_weight, cos, sin)
    out, stock = qk_norm_rotary(*args), qk_norm_rotary_ref(*args)
    # a normalised value one ulp apart (the mean square's order, rsqrt) moves a rotated sum by a few of its ulps
    torch.testing.assert_close(out.float(), stock.float(), atol=2 ** -6, rtol=2 ** -6)
    assert (out != stock).float().mean() < 0.01
