"""FP8 on the GPU: the FP8 GEMM kernels against their torch reference at every row count a step has, with channel,
per-tensor (static) and 128x128 block scales and every epilogue; an FP8 target decodes losslessly with every
drafter in CUDA graphs (greedy speculative output = the FP8 target's own greedy output), without host syncs. An FP8
KV cache: the KV write and the paged attention (verify runs, draft steps, split keys, draft trees, the write fused
into the attention) against their references with per-tensor scales; speculation over it lossless in graphs, compiled
too; the same memory holds twice the pages."""
import pytest
import torch

from tllm_spec import DraftTargetConfig, Eagle3Config, SAConfig, SamplingParams
from tllm_spec.kernels.fp8_linear import FP8, FP8_MAX, MAX_ROWS, fp8_linear, fp8_linear_op, fp8_linear_ref
from tllm_spec.engine.runner import _auto_num_pages
from tllm_spec.kernels.fp8_quant import quantize_activation, quantize_activation_ref
from tllm_spec.kernels.kv_write import kv_write, kv_write_ref
from tllm_spec.kernels.paged_attention import paged_attention, paged_attention_ref
from tllm_spec.kernels.rms_norm import rms_norm, rms_norm_fp8
from tllm_spec.kernels.skinny_linear import rotate_columns_ref
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
@pytest.mark.parametrize("rows,k", [(1, 4096), (7, 14336), (64, 384), (3, 256), (200, 1024), (2, 20480)])
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
    g = torch.Generator(device="cuda").manual_seed(n + k + rows + 1)  # not the global RNG: the same in any order
    bias = torch.randn(n, device="cuda", generator=g).bfloat16()
    residual = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    for kwargs in ({}, {"bias": bias}, {"residual": residual}, {"gated": True},
                   {"scale_ub": 2.0} if not block and xs is None else {}):
        out = fp8_linear(x, w, ws, input_scale=xs, block_scales=block, **kwargs)
        ref = fp8_linear_ref(x, w, ws, input_scale=xs, block_scales=block, **kwargs)
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        # both quantize x to the same bits; they differ in the order of the fp32 sums and in bf16 roundings. With a
        # residual the product is rounded before the add: one bf16 ulp of it (1/32 at 4 to 8) may be all that is
        # left where the add cancels (an H200 run: 0.03125 against a reference of 0, 1 element of 262144)
        atol = 2 ** -4 if "residual" in kwargs else 3e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=3e-2)


@pytest.mark.parametrize("scales", ["channel", "tensor", "block"])
@pytest.mark.parametrize("rows", [1, 4, 17, 26, 33, 64, 65])
@pytest.mark.parametrize("width", [128, 64])
def test_rotary_epilogue_is_the_stock_rotation(scales, rows, width):
    """A fused q|k|v projection (32 q and 8 k heads of 128 rotated, whole or their first 64 features as GLM-4.5's
    partial rotary embedding; 8 v heads not): the kernel's rotary epilogue (up to MAX_ROWS rows; cuBLASLt and the
    stock rotation after it above) gives the stock rotation of its own unrotated result bit for bit, and the
    reference's result; rows its norm quantized take it too."""
    n, k, rotary_cols = 6144, 4096, 5120
    x, w, ws, xs = _operands(rows, n, k, scales, seed=rows + 7)
    g = torch.Generator(device="cuda").manual_seed(rows)
    cos, sin = torch.rand(2, rows, width, device="cuda", generator=g).bfloat16().unbind(0)
    scheme = {"input_scale": xs, "block_scales": scales == "block"}
    rope = {"rope_cos": cos, "rope_sin": sin, "rotary_cols": rotary_cols, "head_dim": 128}
    out, plain = fp8_linear(x, w, ws, **scheme, **rope), fp8_linear(x, w, ws, **scheme)
    assert torch.equal(out, rotate_columns_ref(plain, cos, sin, rotary_cols, 128))
    torch.testing.assert_close(out.float(), fp8_linear_ref(x, w, ws, **scheme, **rope).float(), atol=3e-2, rtol=3e-2)
    if scales == "channel":
        x_q, x_scale = quantize_activation(x)
        assert torch.equal(fp8_linear(x_q, w, ws, x_scale=x_scale, out_dtype=x.dtype, **rope), out)


@pytest.mark.parametrize("scale_ub", [None, 3.0])
@pytest.mark.parametrize("rows,width", [(1, 4096), (4, 192), (33, 5120)])
def test_the_norms_fp8_rows_are_the_quantization_kernels_bitwise(rows, width, scale_ub):
    """rms_norm_fp8 (the norm's kernel writing FP8 rows) = rms_norm then quantize_activation, bit for bit, and the
    GEMM gives the same result from either."""
    x = torch.randn(rows, width, device="cuda").bfloat16() * 4
    weight = torch.rand(width, device="cuda").bfloat16() + 0.5
    q, scale = rms_norm_fp8(x, weight, 1e-5, scale_ub)
    normed = rms_norm(x, weight, 1e-5)
    q_ref, scale_ref = quantize_activation(normed, scale_ub=scale_ub)
    assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    _, w, ws, _ = _operands(1, 256, width, "channel", seed=width)
    assert torch.equal(fp8_linear(q, w, ws, scale_ub=scale_ub, x_scale=scale, out_dtype=x.dtype),
                       fp8_linear(normed, w, ws, scale_ub=scale_ub))


@pytest.mark.parametrize("n,k", [(4096, 14336), (4096, 4096), (6144, 4096)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(n, k):
    """A verify step's row equals the plain step's (the greedy lossless invariant) up to 32 rows, whatever tile
    the row count picks (16 or 32 rows); from 33 to MAX_ROWS (the 64-row tile) likewise among themselves."""
    x, w, ws, _ = _operands(MAX_ROWS, n, k, "channel", seed=3)
    for first, counts in ((1, (2, 4, 16, 17, 26, 32)), (33, (40, 48, MAX_ROWS))):
        alone = fp8_linear(x[:first], w, ws)[:1]
        for rows in counts:
            assert torch.equal(fp8_linear(x[:rows], w, ws)[:1], alone), rows


def test_fp32_activations_and_op_under_compile():
    x, w, ws, _ = _operands(4, 256, 512, "channel", seed=1, dtype=torch.float32)
    torch.testing.assert_close(fp8_linear(x, w, ws), fp8_linear_ref(x, w, ws), atol=1e-4, rtol=1e-4)
    xb = x.bfloat16()
    compiled = torch.compile(lambda a: fp8_linear_op(a, w, ws, None), fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(xb).float(), fp8_linear_ref(xb, w, ws).float(), atol=3e-2, rtol=3e-2)
    assert MAX_ROWS == 64  # the row counts of test_kernel_matches_reference cover both sides of it


def test_online_quantization_is_close_to_the_16_bit_layer():
    layer = torch.nn.Linear(1024, 512, bias=True, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8Linear.quantize(layer)
    x = torch.randn(3, 7, 1024, device="cuda", dtype=torch.bfloat16)
    rel = (fp8(x).float() - layer(x).float()).norm() / layer(x).float().norm()
    assert fp8(x).shape == (3, 7, 512) and rel < 0.05, rel


def _kv_operands(runs: int, query_len: int, context: int, seed: int, new_scale: float = 1.0):
    """An FP8 KV cache of ``runs`` requests with ``context`` cached positions each, their block tables, and a verify
    run of ``query_len`` new tokens after them (their K/V standard normal times ``new_scale``: 200 makes some
    clamp). Attention cases keep every value near 1, as the bf16 kernel's tests do: its probabilities round to bf16
    before the product with V (as the bf16 path's), an error that grows with |V| (values of hundreds put outputs
    of hundreds an ulp of 1 apart, beyond any tolerance meant for the kernel's logic)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    page, hkv, hq, d = 16, 2, 8, 128
    pages_per_run = -(-(context + query_len) // page)
    k_cache = torch.randn(runs * pages_per_run + 1, page, hkv, d, device="cuda", generator=g).to(FP8)
    v_cache = torch.randn(runs * pages_per_run + 1, page, hkv, d, device="cuda", generator=g).to(FP8)
    block_tables = (torch.randperm(runs * pages_per_run, device="cuda", generator=g) + 1).int().view(runs, -1)
    slots = torch.arange(runs, device="cuda").repeat_interleave(query_len)
    positions = (context + torch.arange(query_len, device="cuda")).repeat(runs)
    q = torch.randn(runs * query_len, hq, d, device="cuda", generator=g).bfloat16()
    new_kv = tuple(torch.randn(runs * query_len, hkv, d, device="cuda", generator=g).bfloat16() * new_scale
                   for _ in range(2))
    return q, k_cache, v_cache, block_tables, slots, positions, new_kv


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.5, 2.0)])
def test_fp8_kv_write_matches_reference_bitwise(k_scale, v_scale):
    _, k_cache, v_cache, block_tables, slots, positions, (k, v) = _kv_operands(3, 4, 40, seed=7, new_scale=200.0)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kv_write(k, v, k_cache, v_cache, block_tables, slots, positions, k_scale, v_scale)
    kv_write_ref(k, v, ref_k, ref_v, block_tables, slots, positions, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
    assert not v_cache.float().isnan().any()  # out of range: clamped to +-448


@pytest.mark.parametrize("query_len,context,fused_write,tree", [(1, 37, False, False), (4, 37, True, False),
                                                               (4, 3000, True, False), (4, 3000, False, False),
                                                               (5, 300, False, True)])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.25, 3.0)])
def test_paged_attention_over_an_fp8_cache_matches_reference(query_len, context, fused_write, tree, k_scale,
                                                             v_scale):
    q, k_cache, v_cache, block_tables, slots, positions, new_kv = _kv_operands(3, query_len, context, seed=context)
    tree_mask = None
    if tree:  # token i sees itself and the token right above it only
        tree_mask = (1 | (torch.arange(len(positions), device="cuda") % query_len > 0).long() * 2)
    args = (block_tables, slots, positions, 0.1, context + query_len)
    kwargs = {"query_len": query_len, "tree_mask": tree_mask, "k_scale": k_scale, "v_scale": v_scale}
    ref_caches = (k_cache.clone(), v_cache.clone())
    if fused_write:
        out = paged_attention(q, k_cache, v_cache, *args, new_kv=new_kv, **kwargs)
    else:
        kv_write(*new_kv, k_cache, v_cache, block_tables, slots, positions, k_scale, v_scale)
        out = paged_attention(q, k_cache, v_cache, *args, **kwargs)
    ref = paged_attention_ref(q, *ref_caches, *args, new_kv=new_kv, **kwargs)
    assert torch.equal(k_cache.view(torch.uint8), ref_caches[0].view(torch.uint8))
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_an_fp8_kv_pool_holds_twice_the_pages():
    shapes = [(8, 128)] * 32
    pages = [_auto_num_pages(shapes, 16, 10**9, 0.3, torch.device("cuda"), dtype)
             for dtype in (torch.bfloat16, FP8)]
    assert abs(pages[1] / pages[0] - 2) < 0.01


@pytest.mark.parametrize("kind,compiled", [("eagle3", True), ("eagle3", False), ("tree", False), ("sa", False)])
def test_speculation_over_an_fp8_kv_cache_is_lossless_in_graphs(kind, compiled):
    plain, spec = _fp8_models(kind, quantization=None, kv_cache_dtype="fp8", compile_step=compiled)
    assert spec.runner.kv_cache.dtype == FP8 and spec.runner.graph_runner.compile_step == compiled
    params = [SamplingParams(max_new_tokens=n) for n in MAX_NEW]
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    got = spec.generate(PROMPTS, params)
    assert spec.runner.graph_runner.graphs, "no CUDA graph was used"
    assert [o.token_ids for o in got] == expected


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


def test_bf16_fp8_target_rotates_in_the_qkv_epilogue_and_stays_lossless_in_graphs(tmp_path, monkeypatch):
    """bf16 compute (the few-row path; the fp32 tests above take the stock one): heads of 64, so the FP8 qkv GEMM's
    programs hold whole rotary pairs and its epilogue rotates (the stock rotation after it never runs), and EAGLE-3
    speculation equals the FP8 target's own greedy output in CUDA graphs."""
    from tllm_spec.kernels import fp8_linear as fp8_module
    from tllm_spec.tools.random_models import save_random_head, save_random_target, target_config
    cfg = target_config("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                        intermediate_size=512, vocab_size=97, num_hidden_layers=8)
    target = save_random_target(tmp_path / "target", cfg, seed=5)
    head = save_random_head(tmp_path / "head", cfg, seed=6)
    fallbacks = []  # the row counts the stock rotation after the GEMM took: prompt chunks only (cuBLASLt's)
    monkeypatch.setattr(fp8_module, "rotate_columns_ref",
                        lambda y, *a: fallbacks.append(y.shape[0]) or rotate_columns_ref(y, *a))
    options = {"dtype": torch.bfloat16, "device": "cuda", "max_batch_size": 8, "quantization": "fp8"}
    plain = SpecModel.from_pretrained(target, None, **options)
    spec = SpecModel.from_pretrained(target, Eagle3Config(speculative_model=str(head), max_draft_len=3), **options)
    params = [SamplingParams(max_new_tokens=n) for n in MAX_NEW]
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == expected
    assert spec.runner.graph_runner.graphs and all(rows > fp8_module.MAX_ROWS for rows in fallbacks)


def test_no_host_sync_inside_an_fp8_step():
    _, spec = _fp8_models("eagle3", enforce_eager=True)
    assert_no_host_sync_in_generation_steps(spec, PROMPTS[:2])
