"""The RMSNorm kernel on the GPU (a decoding step's rows and a prompt's): the stock module's ops to the last bit but
where summation order tips a rounding."""
import pytest
import torch

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
