"""The skinny-GEMM kernel on the GPU: its reference's result for a decoding step's rows; cuBLAS elsewhere."""
import pytest
import torch
import torch.nn.functional as F

from tllm_spec.kernels import dependent_launch
from tllm_spec.kernels.paged_attention import paged_attention
from tllm_spec.kernels.rms_norm import rms_norm
from tllm_spec.kernels.skinny_linear import (
    MAX_ROWS,
    skinny_linear,
    skinny_linear_op,
    skinny_linear_ref,
    supports,
    tile_config,
)
from tllm_spec.model.rotary import apply_rotary

pytestmark = pytest.mark.cuda


def _operands(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int):
    """x [rows, k], w [n, k] (scaled to unit outputs) and an optional bias [n], seeded."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(dtype)
    return x, w, torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (32000, 4096), (1000, 200), (72, 1030)])
@pytest.mark.parametrize("rows", [1, 3, 4, 16, 26, 32])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_fp32_reference(dtype, n, k, rows, bias):
    x, w, b = _operands(rows, n, k, dtype, bias, seed=n + k + rows)
    assert supports(x, w, b)
    out = skinny_linear(x, w, b)
    ref = F.linear(x.float(), w.float(), b.float() if bias else None)
    assert out.dtype == dtype and out.shape == (rows, n)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for config in {tile_config(n, k, rows), (16, 64, 4, 2), (64, 128, 8, 3)}:  # every tile shape gives the same sums
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
@pytest.mark.parametrize("rows", [1, 4, 16, 26])
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
@pytest.mark.parametrize("rows", [1, 4, 32])
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,head_dim,width,bias", [((32, 8), 128, 128, False), ((28, 4), 128, 128, True),
                                                       ((12, 4), 64, 64, False), ((48, 4), 128, 64, True)])
@pytest.mark.parametrize("rows", [1, 4, 16, 26])
def test_rotary_epilogue_is_the_stock_rotation(dtype, heads, head_dim, width, bias, rows):
    """RoPE in the q|k|v GEMM's epilogue (Llama-3.1-8B, a Qwen2-7B-like shape with biases, a 64-wide head, and
    GLM-4.5-Air's TP-2 share: biases, half of each head rotated): the fp32 reference's result; and with
    small-integer operands, whose sums are exact in any order, exactly the stock rotation, in the model dtype, of
    the kernel's own plain projection (the rest of each head and v untouched)."""
    num_heads, num_kv_heads = heads
    n, rotary_cols = (num_heads + 2 * num_kv_heads) * head_dim, (num_heads + num_kv_heads) * head_dim
    x, w, b = _operands(rows, n, 4096, dtype, bias, seed=n + rows)
    angles = torch.rand(rows, 1, device="cuda") * 1000 * torch.rand(width, device="cuda")  # halves differ
    cos, sin = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)
    rope = dict(rope_cos=cos, rope_sin=sin, rotary_cols=rotary_cols, head_dim=head_dim)
    assert supports(x, w, b, **rope)
    out = skinny_linear(x, w, b, **rope)
    ref = skinny_linear_ref(x.float(), w.float(), None if b is None else b.float(), rope_cos=cos.float(),
                            rope_sin=sin.float(), rotary_cols=rotary_cols, head_dim=head_dim)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=2e-2)
    x, w = x.float().mul(2).round().to(dtype), (w.float() * 64).round().div(8).to(dtype)
    out = skinny_linear(x, w, b, **rope)
    plain = skinny_linear(x, w, b)
    heads_view = plain[:, :rotary_cols].view(rows, -1, head_dim)
    rotated = torch.cat([apply_rotary(heads_view[..., :width], cos[:, None], sin[:, None]), heads_view[..., width:]],
                        -1)
    expected = torch.cat([rotated.flatten(1), plain[:, rotary_cols:]], 1)
    assert torch.equal(out, expected)


def test_dependent_launches_replay_in_a_cuda_graph(monkeypatch):
    """On Hopper the kernels launch as programmatic dependents: a chain of them (norm -> rotary qkv -> attention
    writing its K/V, with the K/V prefetch before its wait -> o with residual -> gated gate/up -> down with
    residual) captured in a CUDA graph replays, every time, to what the same chain gives launched normally."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    assert dependent_launch.launches_dependent(torch.empty(1, device="cuda"))
    with monkeypatch.context() as m:  # the switch a profile turns PDL off with
        m.setenv(dependent_launch.DEPENDENT_LAUNCH_VAR, "0")
        assert not dependent_launch.launches_dependent(torch.empty(1, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(4, 4096, device="cuda", generator=g).bfloat16()
    ws = [(torch.randn(*shape, device="cuda", generator=g) * shape[1] ** -0.5).bfloat16()
          for shape in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))]
    norm_w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    cos, sin = torch.rand(2, 4, 128, device="cuda", generator=g).bfloat16().unbind(0)
    pages = torch.randn(2, 40, 16, 8, 128, device="cuda", generator=g).bfloat16()
    block_tables = torch.arange(1, 17, device="cuda", dtype=torch.int32).view(2, 8)
    slots, positions = torch.zeros(4, dtype=torch.int64, device="cuda"), torch.arange(100, 104, device="cuda")

    def chain(h, k_cache, v_cache):
        qkv = skinny_linear(rms_norm(h, norm_w, 1e-5), ws[0], rope_cos=cos, rope_sin=sin, rotary_cols=5120)
        q, k, v = (qkv[:, a:b].view(4, -1, 128) for a, b in ((0, 4096), (4096, 5120), (5120, 6144)))
        attn = paged_attention(q, k_cache, v_cache, block_tables, slots, positions, 128 ** -0.5, 256, None, 4,
                               new_kv=(k, v))
        h = skinny_linear(attn.flatten(1), ws[1], residual=h)
        return skinny_linear(skinny_linear(rms_norm(h, norm_w, 1e-5), ws[2], gated=True), ws[3], residual=h)
    with monkeypatch.context() as m:
        m.setattr(dependent_launch, "launches_dependent", lambda t: False)
        expected = chain(h, *pages.clone().unbind(0))
    caches = pages.clone().unbind(0)
    chain(h, *caches)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(h, *caches)
    for _ in range(3):
        out.zero_()
        graph.replay()
        assert torch.equal(out, expected)
