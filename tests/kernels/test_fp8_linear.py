"""The FP8 GEMM's torch reference (the CPU path and the kernels' oracle) and its custom op: activation
quantization per token, per 128-column group and static; weight dequantization per channel and per block; the op's
fake and real implementations agree (opcheck). (Triton's CPU interpreter rounds fp32 -> FP8 wrongly across powers
of two, so the kernel itself is checked on the GPU only: tests/gpu/test_fp8_gpu.py.)"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tllm_spec.kernels.fp8_linear import (
    FP8,
    FP8_MAX,
    dequantize_weight,
    fp8_linear_op,
    fp8_linear_ref,
    quantize_activation,
)
from tllm_spec.kernels.rms_norm import rms_norm_fp8_op, rms_norm_ref
from tllm_spec.model.layers import fuse_linears, linear, norm_for
from tllm_spec.model.quant.linear import Fp8Linear, QuantizedRows, quantize_linears


def test_dynamic_per_token_quantization_uses_each_rows_maximum():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [300.0, 1.0, -900.0, 2.0]])
    x_q, scale = quantize_activation(x)
    assert x_q.dtype == FP8 and scale.shape == (3, 1)
    assert scale[0, 0] == torch.tensor(2.0) * (1 / FP8_MAX) and scale[2, 0] == torch.tensor(900.0) * (1 / FP8_MAX)
    assert x_q[0, 1].float() == -FP8_MAX and torch.equal(x_q[1].float(), torch.zeros(4))  # a zero row: zeros
    clamped_q, clamped = quantize_activation(x, scale_ub=400.0)
    assert clamped[2, 0] == torch.tensor(400.0) * (1 / FP8_MAX) and clamped_q[2, 2].float() == -FP8_MAX  # clipped


def test_group_and_static_quantization():
    x = torch.cat([torch.full((2, 128), 1.0), torch.full((2, 128), 100.0)], dim=1)
    _, scale = quantize_activation(x, group=128)
    assert scale.shape == (2, 2) and torch.allclose(scale[0], torch.tensor([1.0, 100.0]) / FP8_MAX)
    x_q, static = quantize_activation(x, input_scale=torch.tensor(0.5))
    assert torch.equal(static, torch.full((2, 1), 0.5)) and x_q[0, 0].float() == 2.0 and x_q[0, 200].float() == 192.0


def test_block_dequantization_scales_each_block():
    weight = torch.ones(256, 384).to(FP8)
    scale = torch.arange(6, dtype=torch.float32).view(2, 3)
    w = dequantize_weight(weight, scale, (128, 128))
    assert w[0, 0] == 0 and w[0, 200] == 1 and w[200, 300] == 5 and w.shape == (256, 384)


@pytest.mark.parametrize("block", [False, True])
def test_reference_is_the_dequantized_product(block):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 256, generator=g), torch.randn(128, 256, generator=g)
    scale = torch.rand(1, 2, generator=g) + 0.5 if block else torch.rand(128, generator=g) + 0.5
    weight = (w / (scale.repeat_interleave(128, 0).repeat_interleave(128, 1) if block else scale[:, None])).to(FP8)
    x_q, x_scale = quantize_activation(x, group=128 if block else 0)
    x_dq = (x_q.float().view(5, x_scale.shape[1], -1) * x_scale[..., None]).view(5, 256)
    expected = F.linear(x_dq, dequantize_weight(weight, scale, (128, 128) if block else None))
    assert torch.equal(fp8_linear_ref(x, weight, scale, block_scales=block), expected)
    assert (expected - x @ w.T).norm() / (x @ w.T).norm() < 0.08  # FP8's few mantissa bits, not a wrong layout


@pytest.mark.parametrize("bias", [False, True])
def test_op_passes_opcheck(bias):
    layer = Fp8Linear.quantize(nn.Linear(32, 24, bias=bias))
    args = (torch.randn(3, 32), layer.weight, layer.weight_scale, layer.bias)
    checks = ("test_faketensor", "test_aot_dispatch_dynamic")  # the schema check multiplies FP8 inputs on the CPU
    torch.library.opcheck(fp8_linear_op, args, test_utils=checks)
    torch.library.opcheck(fp8_linear_op, args, dict(gated=True), test_utils=checks)
    x_q, x_scale = quantize_activation(args[0])
    torch.library.opcheck(fp8_linear_op, (x_q, *args[1:]), dict(x_scale=x_scale, out_dtype=torch.float32),
                          test_utils=checks)
    cos, sin = torch.randn(2, 3, 8).unbind(0)  # heads of 8: the q|k features 0..15 rotated
    torch.library.opcheck(fp8_linear_op, args, dict(rope_cos=cos, rope_sin=sin, rotary_cols=16), test_utils=checks)


def test_the_rotary_epilogues_reference_rotates_the_q_and_k_heads_of_the_projection():
    """rope_cos, rope_sin: the first rotary_cols features rotated per head (the stock rotation), as the bf16 path
    does, then the residual; an FP8 layer takes the rotation through layers.linear as a bf16 one does."""
    from tllm_spec.kernels.skinny_linear import rotate_columns_ref
    layer = Fp8Linear.quantize(nn.Linear(32, 48, bias=True))
    x, residual = torch.randn(3, 32), torch.randn(3, 48)
    cos, sin = torch.randn(2, 3, 8).unbind(0)
    plain = fp8_linear_ref(x, layer.weight, layer.weight_scale, layer.bias)
    rotated = fp8_linear_ref(x, layer.weight, layer.weight_scale, layer.bias, residual=residual, rope_cos=cos,
                             rope_sin=sin, rotary_cols=32)
    assert torch.equal(rotated, residual + rotate_columns_ref(plain, cos, sin, 32))
    assert torch.equal(rotated[:, 32:], residual[:, 32:] + plain[:, 32:]) and not torch.equal(rotated, residual + plain)
    assert torch.equal(linear(x, layer, residual=residual, rope=(cos[:, None], sin[:, None]), rotary_cols=32), rotated)


@pytest.mark.parametrize("scale_ub", [None, 0.5])
def test_rows_quantized_by_the_norm_give_the_same_projection(scale_ub):
    """The RMSNorm's FP8 output (rms_norm_fp8: the norm, then the per-token quantization) into the GEMM is the
    norm's bf16 rows quantized by the GEMM itself, bit for bit; a layer with static or block scales never takes it."""
    torch.manual_seed(0)
    norm = nn.RMSNorm(64, eps=1e-6).bfloat16()
    norm.weight.data.uniform_(0.5, 1.5)
    layer = Fp8Linear.quantize(nn.Linear(64, 48).bfloat16())
    layer.scale_ub = scale_ub
    x = torch.randn(5, 64).bfloat16() * 3
    q, scale = rms_norm_fp8_op(x, norm.weight, 1e-6, scale_ub)
    assert (q.dtype, scale.shape) == (FP8, (5, 1))
    expected = layer.project(rms_norm_ref(x, norm.weight, 1e-6))
    assert torch.equal(layer.project(QuantizedRows(q, scale, x.dtype)), expected)
    norm.variance_epsilon = 1e-6
    assert isinstance(norm_for(x, norm, layer), QuantizedRows) and layer.quantizes_per_token
    static = Fp8Linear(layer.weight, layer.weight_scale, input_scale=torch.tensor([0.01]))
    assert torch.equal(norm_for(x, norm, static), rms_norm_ref(x, norm.weight, 1e-6))
    with pytest.raises(ValueError, match="one scale per row"):
        fp8_linear_ref(q, layer.weight, layer.weight_scale, x_scale=scale)  # no out_dtype
    torch.library.opcheck(rms_norm_fp8_op, (x, norm.weight, 1e-6, scale_ub), test_utils=("test_faketensor",))


def test_fused_projections_keep_each_parts_scales():
    torch.manual_seed(0)
    parts = [Fp8Linear.quantize(nn.Linear(64, rows)) for rows in (32, 16, 16)]
    x = torch.randn(4, 64)
    expected = torch.cat([p(x) for p in parts], dim=1)
    fused = fuse_linears(parts)
    assert isinstance(fused, Fp8Linear) and torch.equal(linear(x, fused), expected)
    assert parts[1].weight.data_ptr() == fused.weight[32:].data_ptr()  # views: no second copy
    assert torch.equal(parts[2](x), expected[:, 48:])
    with pytest.raises(ValueError, match="FP8 and unquantized"):
        fuse_linears([Fp8Linear.quantize(nn.Linear(64, 8)), nn.Linear(64, 8)])


def test_quantize_linears_leaves_heads_and_replaces_the_rest():
    model = nn.ModuleDict({"proj": nn.Linear(16, 16), "lm_head": nn.Linear(16, 40),
                           "block": nn.ModuleDict({"inner": nn.Linear(16, 8)})})
    assert quantize_linears(model) == 2
    assert isinstance(model["proj"], Fp8Linear) and isinstance(model["block"]["inner"], Fp8Linear)
    assert type(model["lm_head"]) is nn.Linear
