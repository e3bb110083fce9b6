"""The RMSNorm kernel on the GPU: the stock module's ops to the last bit but where summation order tips one."""
import pytest
import torch

from tllm_spec.kernels.rms_norm import rms_norm, rms_norm_ref

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("width", [4096, 5120, 1000])
def test_rms_norm_kernel_matches_the_stock_ops(dtype, rows, width):
    g = torch.Generator(device="cuda").manual_seed(rows + width)
    x = (3 * torch.randn(rows, width, device="cuda", generator=g)).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, device="cuda", generator=g)).to(dtype)
    out = rms_norm(x, weight, 1e-5)
    stock = rms_norm_ref(x, weight, 1e-5)
    # the stock ops' bits but where the mean square's summation order tips a rounding: at most one ulp
    torch.testing.assert_close(out.float(), stock.float(), atol=0, rtol=2 ** -7)
    assert (out != stock).float().mean() < 0.01
