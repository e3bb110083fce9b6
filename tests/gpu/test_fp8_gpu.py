"""FP8 on the GPU: the FP8 GEMM kernels against their torch reference at every row count a step has, with channel,
per-tensor (static) and 128x128 block scales and every epilogue; an FP8 target decodes losslessly with every
drafter in CUDA graphs (greedy speculative output = the FP8 target's own greedy output), without host syncs."""
import pytest
import torch

from tllm_spec import DraftTargetConfig, Eagle3Config, SAConfig, SamplingParams
from tllm_spec.kernels.fp8_linear import FP8, FP8_MAX, MAX_ROWS, fp8_linear, fp8_linear_op, fp8_linear_ref
from tllm_spec.kernels.fp8_quant import quantize_activation, quantize_activation_ref
from tllm_spec.model.quant.linear import Fp8Linear
from tllm_spec.spec_model import SpecModel

from ..models import tiny_draft_lm, tiny_pair
from .test_engine_gpu import MAX_NEW, PROMPTS, assert_no_host_sync_in_generation_steps

pytestmark = pytest.mark.cuda


def _operands(rows: int, n: int, k: int, scales: str, seed: int, dtype=torch.bfloat16):
    """x [rows, k], an FP8 weight [n, k] with ``scales`` ("channel", "tensor" = static input scale too, "block")."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=g).to(dtype)
    w = torch.randn(n, k, device="cuda", generator=g) * k ** -0.5
    input_scale = None
    if scales == "block":
        amax = w.abs().unflatten(0, (-1, 128)).unflatten(2, (-1, 128)).amax(dim=(1, 3))
        scale = amax / FP8_MAX
        weight = (w / scale.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(FP8)
    else:
        scale = w.abs().amax(1) / FP8_MAX
        if scales == "tensor":
            scale = scale.max().expand(n).contiguous()
            input_scale = x.float().abs().max().reshape(1) / FP8_MAX
        weight = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x, weight, scale.float(), input_scale


@pytest.mark.parametrize("mode", ["token", "bound", "static", "group"])
@pytest.mark.parametrize("rows,k", [(1, 4096), (7, 14336), (64, 384), (3, 256), (200, 1024)])
def test_quantization_kernel_matches_reference_bitwise(mode, rows, k):
    x = torch.randn(rows, k, device="cuda").bfloat16() * torch.rand(rows, 1, device="cuda").bfloat16() * 8
    x[0, :5] = 0.0
    args = {"token": {}, "bound": {"scale_ub": 3.0}, "static": {"input_scale": torch.tensor([0.02], device="cuda")},
            "group": {"group": 128}}[mode]
    q, scale = quantize_activation(x, **args)
    q_ref, scale_ref = quantize_activation_ref(x, **args)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("scales", ["channel", "tensor", "block"])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1024, 384), (640, 256)])
@pytest.mark.parametrize("rows", [1, 3, 4, 16, 17, 26, 33, 64, 65, 200])
def test_kernel_matches_reference(scales, n, k, rows):
    x, w, ws, xs = _operands(rows, n, k, scales, seed=n + k + rows)
    block = scales == "block"
    bias = torch.randn(n, device="cuda").bfloat16()
    for kwargs in ({}, {"bias": bias}, {"residual": torch.randn(rows, n, device="cuda").bfloat16()},
                   {"gated": True}, {"scale_ub": 2.0} if not block and xs is None else {}):
        out = fp8_linear(x, w, ws, input_scale=xs, block_scales=block, **kwargs)
        ref = fp8_linear_ref(x, w, ws, input_scale=xs, block_scales=block, **kwargs)
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        # both quantize x to the same bits; they differ in the order of the fp32 sums and in bf16 roundings
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_fp32_activations_and_op_under_compile():
    x, w, ws, _ = _operands(4, 256, 512, "channel", seed=1, dtype=torch.float32)
    torch.testing.assert_close(fp8_linear(x, w, ws), fp8_linear_ref(x, w, ws), atol=1e-4, rtol=1e-4)
    xb = x.bfloat16()
    compiled = torch.compile(lambda a: fp8_linear_op(a, w, ws, None), fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(xb).float(), fp8_linear_ref(xb, w, ws).float(), atol=3e-2, rtol=3e-2)
    assert MAX_ROWS == 32  # the row counts of test_kernel_matches_reference cover both sides of it


def test_online_quantization_is_close_to_the_16_bit_layer():
    layer = torch.nn.Linear(1024, 512, bias=True, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8Linear.quantize(layer)
    x = torch.randn(3, 7, 1024, device="cuda", dtype=torch.bfloat16)
    rel = (fp8(x).float() - layer(x).float()).norm() / layer(x).float().norm()
    assert fp8(x).shape == (3, 7, 512) and rel < 0.05, rel


def _fp8_models(kind: str, **engine):
    target, head = tiny_pair("llama")
    spec = {"eagle3": lambda: Eagle3Config(speculative_model=str(head), max_draft_len=3),
            "tree": lambda: Eagle3Config(speculative_model=str(head), max_draft_len=3,
                                         eagle_choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]]),
            "draft_lm": lambda: DraftTargetConfig(speculative_model=str(tiny_draft_lm("llama")), max_draft_len=3),
            "sa": lambda: SAConfig(max_draft_len=3)}[kind]()
    options = {"dtype": torch.float32, "device": "cuda", "max_batch_size": 8, "quantization": "fp8", **engine}
    return SpecModel.from_pretrained(target, None, **options), SpecModel.from_pretrained(target, spec, **options)


@pytest.mark.parametrize("kind", ["eagle3", "tree", "draft_lm", "sa"])
def test_fp8_target_speculation_is_lossless_in_graphs(kind):
    plain, spec = _fp8_models(kind)
    assert isinstance(spec.runner.target.hf.model.layers[0].mlp.down_proj, Fp8Linear)
    params = [SamplingParams(max_new_tokens=n) for n in MAX_NEW]
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    got = spec.generate(PROMPTS, params)
    assert spec.runner.graph_runner is not None and spec.runner.graph_runner.graphs, "no CUDA graph was used"
    assert [o.token_ids for o in got] == expected


def test_no_host_sync_inside_an_fp8_step():
    _, spec = _fp8_models("eagle3", enforce_eager=True)
    assert_no_host_sync_in_generation_steps(spec, PROMPTS[:2])
