"""The skinny-GEMM kernel on the GPU: its reference's result for a decoding step's rows; cuBLAS elsewhere."""
import pytest
import torch
import torch.nn.functional as F

from tllm_spec.kernels.skinny_linear import (MAX_ROWS, skinny_linear, skinny_linear_op, skinny_linear_ref, supports,
                                            tile_config)

pytestmark = pytest.mark.cuda


def _operands(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int):
    """x [rows, k], w [n, k] (scaled to unit outputs) and an optional bias [n], seeded."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(dtype)
    return x, w, torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (32000, 4096), (1000, 200), (72, 1030)])
@pytest.mark.parametrize("rows", [1, 3, 4, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_fp32_reference(dtype, n, k, rows, bias):
    x, w, b = _operands(rows, n, k, dtype, bias, seed=n + k + rows)
    assert supports(x, w, b)
    out = skinny_linear(x, w, b)
    ref = F.linear(x.float(), w.float(), b.float() if bias else None)
    assert out.dtype == dtype and out.shape == (rows, n)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for config in {tile_config(n, k), (16, 64, 4, 2), (64, 128, 8, 3)}:  # every tile shape gives the same sums
        torch.testing.assert_close(skinny_linear(x, w, b, config=config).float(), ref, atol=2e-2, rtol=2e-2)


def test_other_operands_take_cublas_exactly():
    w = torch.randn(256, 128, device="cuda")
    for x, weight in ((torch.randn(4, 128, device="cuda"), w),  # fp32: cuBLAS's rounding is kept
                      (torch.randn(MAX_ROWS + 1, 128, device="cuda").bfloat16(), w.bfloat16()),
                      (torch.randn(128, 4, device="cuda").bfloat16().t(), w.bfloat16())):  # strided rows
        assert not supports(x, weight)
        assert torch.equal(skinny_linear(x, weight), F.linear(x, weight))
    x, weight = torch.randn(4, 128, device="cuda").bfloat16(), w.bfloat16()
    for bias in (torch.randn(512, device="cuda").bfloat16()[::2], torch.randn(256, device="cuda").half()):
        assert not supports(x, weight, bias)  # strided, or another dtype: cuBLAS's answer (or its error)
    strided = torch.randn(512, device="cuda").bfloat16()[::2]
    assert torch.equal(skinny_linear(x, weight, strided), F.linear(x, weight, strided))


def test_op_compiles_into_one_graph_with_dynamic_rows():
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(lambda x: skinny_linear_op(x, w, None).relu(), fullgraph=True, dynamic=True)
    for rows in (2, 5, 64):
        x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(fn(x), F.linear(x, w).relu(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(28672, 4096), (2 * 1000, 200)])
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_kernel_matches_fp32_reference(dtype, n, k, rows, bias):
    """The SwiGLU epilogue at Llama-3.1-8B's gate/up shape and at a feature count that leaves a tail."""
    x, w, b = _operands(rows, n, k, dtype, bias, seed=n + k + rows)
    assert supports(x, w, b, gated=True)
    out = skinny_linear(x, w, b, gated=True)
    ref = skinny_linear_ref(x.float(), w.float(), b.float() if bias else None, gated=True)
    assert out.dtype == dtype and out.shape == (rows, n // 2)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows", [1, 4])
def test_residual_epilogue_matches_fp32_reference(dtype, gated, rows):
    """The o projection's and the down projection's residual add (Llama-3.1-8B shapes)."""
    n, k = (28672, 4096) if gated else (4096, 4096)
    x, w, _ = _operands(rows, n, k, dtype, False, seed=n + rows)
    res = torch.randn(rows, n // 2 if gated else n, device="cuda",
                      generator=torch.Generator(device="cuda").manual_seed(rows)).to(dtype)
    assert supports(x, w, None, gated, res)
    out = skinny_linear(x, w, gated=gated, residual=res)
    ref = skinny_linear_ref(x.float(), w.float(), gated=gated, residual=res.float())
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=2e-2)
