"""FP8 checkpoints as their producers write them (compressed-tensors static, dynamic and block, Hugging Face
fine-grained ``fp8``, ``fbgemm_fp8``, NVIDIA ModelOpt), written here from tiny random Llama and Qwen2 models: every
quantized projection loads as an Fp8Linear holding exactly the stored fp8 values times their scales (the lm_head,
norms and excluded layers as stored), and greedy decoding equals transformers' on the same weights dequantized, each
quantized layer's input quantized as the format says. Other methods are refused in one line naming them; fused
q/k/v with different static input scales quantize with the largest."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from tllm_spec import SamplingParams, SpecModel
from tllm_spec.kernels.fp8_linear import FP8, FP8_MAX, quantize_activation
from tllm_spec.model.quant.checkpoint import UnsupportedQuantization
from tllm_spec.model.quant.linear import Fp8Linear
from tllm_spec.model.target import TargetModel

BLOCK = 128
PROMPT = [5, 17, 3, 44, 9, 2, 71, 5, 17, 3, 44, 60]
MAX_NEW = 12
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Format:
    """How one producer stores an FP8 linear layer, and the config that announces it."""

    weights: str  # "tensor" [] or [1], "channel" [N, 1], "block" [N/128, K/128]
    inputs: str  # "static" (one stored input_scale), "token" (dynamic per row), "group" (per row and 128 columns)
    config: dict  # config.json's quantization_config; {} for ModelOpt (hf_quant_config.json)
    scale_key: str = "weight_scale"
    scale_dtype: torch.dtype = torch.float32  # of the weight and input scales
    scalar_shape: tuple[int, ...] = (1,)  # a per-tensor scale's stored shape
    scale_ub: float | None = None
    quantized: tuple[str, ...] = ATTENTION + MLP  # the projections the producer quantized
    hf_quant_config: dict | None = None
    extra: dict = field(default_factory=dict)  # tensor name suffix (of self_attn) -> value, stored beside


def _ct_group(weights: dict, inputs: dict | None) -> dict:
    common = {"num_bits": 8, "type": "float", "symmetric": True, "observer": "minmax", "actorder": None}
    return {"targets": ["Linear"], "weights": {**common, **weights},
            "input_activations": None if inputs is None else {**common, **inputs}, "output_activations": None}


def compressed_tensors(weights: dict, inputs: dict | None, fmt: str = "float-quantized") -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"], "kv_cache_scheme": None,
            "quantization_status": "compressed", "config_groups": {"group_0": _ct_group(weights, inputs)}}


FBGEMM_SKIP = ["lm_head"] + [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ATTENTION]
FORMATS = {
    # llm-compressor's FP8 static scheme: one weight scale and one calibrated input scale per layer, in bf16
    "ct-static": Format("tensor", "static", compressed_tensors(
        {"strategy": "tensor", "dynamic": False, "group_size": None, "block_structure": None},
        {"strategy": "tensor", "dynamic": False, "group_size": None, "block_structure": None}),
        scale_dtype=torch.bfloat16),
    # *-FP8-dynamic: bf16 channel scales, activations per token at run time
    "ct-dynamic": Format("channel", "token", compressed_tensors(
        {"strategy": "channel", "dynamic": False, "group_size": None, "block_structure": None},
        {"strategy": "token", "dynamic": True, "group_size": None, "block_structure": None}),
        scale_dtype=torch.bfloat16),
    # FP8_BLOCK: 128 x 128 weight blocks, activations per token and 128 columns
    "ct-block": Format("block", "group", compressed_tensors(
        {"strategy": "block", "dynamic": False, "group_size": None, "block_structure": [BLOCK, BLOCK]},
        {"strategy": "group", "dynamic": True, "group_size": BLOCK, "block_structure": None}),
        scale_dtype=torch.bfloat16),
    # DeepSeek-V3 / Qwen3-FP8: fp32 block scales named weight_scale_inv
    "fine-grained": Format("block", "group", {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": ["lm_head"]}, scale_key="weight_scale_inv"),
    # Meta's Llama-3.1-405B-FP8: the MLP alone in FP8, per-token activations clamped to activation_scale_ub
    "fbgemm": Format("channel", "token", {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                          "modules_to_not_convert": FBGEMM_SKIP}, scale_ub=1200.0, quantized=MLP),
    # the same with an upper bound that clamps this model's activations (1200 never does)
    "fbgemm-ub": Format("channel", "token", {"quant_method": "fbgemm_fp8", "activation_scale_ub": 2.0,
                                             "modules_to_not_convert": FBGEMM_SKIP}, scale_ub=2.0, quantized=MLP),
    # TensorRT Model Optimizer's FP8: 0-d fp32 scales, a calibrated input scale, FP8 KV cache scales beside
    "modelopt": Format("tensor", "static", {}, scalar_shape=(), hf_quant_config={
        "producer": {"name": "modelopt", "version": "0.19.0"},
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}},
        extra={"k_proj.k_scale": torch.tensor(0.02), "v_proj.v_scale": torch.tensor(0.01)}),
}


def tiny_model(arch: str, seed: int = 0) -> nn.Module:
    """2 layers, hidden 256 and intermediate 512 (whole 128-blocks), 97 tokens; bf16-representable fp32 weights;
    Qwen2: q/k/v biases."""
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    config = cls(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=None,
                 bos_token_id=None, initializer_range=0.05)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # norms and biases random too, so a mix-up of tensors shows
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            p.copy_(p.to(torch.bfloat16))  # the parameters only: the rotary buffers stay fp32, as loaded
    return model.eval()


def quantized_names(model: nn.Module, fmt: Format) -> list[str]:
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in fmt.quantized]


def quantize_weight(w: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (fp8 [N, K], the stored scale in the format's shape and dtype)."""
    n, k = w.shape
    if fmt.weights == "block":
        amax = w.abs().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK).amax(dim=(1, 3))
    elif fmt.weights == "channel":
        amax = w.abs().amax(dim=1, keepdim=True)
    else:
        amax = w.abs().amax().reshape(fmt.scalar_shape)
    scale = (amax / FP8_MAX).to(fmt.scale_dtype)
    return (w / expand(scale, fmt, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def expand(scale: torch.Tensor, fmt: Format, shape: torch.Size) -> torch.Tensor:
    """A stored weight scale, fp32, broadcast to the weight's [N, K]."""
    scale = scale.float()
    if fmt.weights == "block":
        return scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:shape[0], :shape[1]]
    return scale.reshape(-1, 1).expand(shape)


def input_maxima(model: nn.Module, names: list[str]) -> dict[str, float]:
    """Calibration: each named layer's largest input magnitude over the prompt."""
    maxima: dict[str, float] = {}
    hooks = [model.get_submodule(name).register_forward_pre_hook(
        lambda _, args, name=name: maxima.__setitem__(name, max(maxima.get(name, 0.0), args[0].abs().max().item())))
        for name in names]
    with torch.no_grad():
        model(torch.tensor([PROMPT]))
    for hook in hooks:
        hook.remove()
    return maxima


def write_checkpoint(path: Path, model: nn.Module, fmt: Format, input_scale_factors: dict[str, float] | None = None
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """``model`` saved in bf16 at ``path``, its quantized projections replaced by the format's FP8 tensors and its
    config announcing the format. Returns name -> (fp8 weight, stored scale, input scale or None)."""
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(path)
    names = quantized_names(model, fmt)
    maxima = input_maxima(model, names) if fmt.inputs == "static" else {}
    tensors = {k: v.contiguous() for k, v in load_file(path / "model.safetensors").items()}
    written = {}
    for name in names:
        weight, scale = quantize_weight(model.get_submodule(name).weight.detach(), fmt)
        tensors[f"{name}.weight"], tensors[f"{name}.{fmt.scale_key}"] = weight, scale
        input_scale = None
        if fmt.inputs == "static":
            factor = (input_scale_factors or {}).get(name.rsplit(".", 1)[-1], 1.0)
            input_scale = torch.tensor(maxima[name] * factor / FP8_MAX).reshape(fmt.scalar_shape).to(fmt.scale_dtype)
            tensors[f"{name}.input_scale"] = input_scale
        written[name] = (weight, scale, input_scale)
    for i in range(model.config.num_hidden_layers):
        tensors |= {f"model.layers.{i}.self_attn.{suffix}": value.clone() for suffix, value in fmt.extra.items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    if fmt.hf_quant_config is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(fmt.hf_quant_config))
    else:
        config["quantization_config"] = fmt.config
    (path / "config.json").write_text(json.dumps(config))
    return written


def qdq(x: torch.Tensor, fmt: Format, input_scale: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] quantized to FP8 as the format says and back."""
    rows = x.reshape(-1, x.shape[-1])
    group = BLOCK if fmt.inputs == "group" else 0
    x_q, scale = quantize_activation(rows, input_scale, group, fmt.scale_ub)
    x_dq = x_q.float().view(rows.shape[0], scale.shape[1], -1) * scale[..., None]
    return x_dq.reshape(x.shape).to(x.dtype)


def reference(model: nn.Module, fmt: Format, written: dict) -> nn.Module:
    """transformers' model in fp32 holding the dequantized weights, each quantized layer's input quantized and
    dequantized by a pre-hook: the checkpoint's maths."""
    for name, (weight, scale, input_scale) in written.items():
        layer = model.get_submodule(name)
        layer.weight.data = weight.float() * expand(scale, fmt, weight.shape)
        layer.register_forward_pre_hook(lambda _, args, s=input_scale: (qdq(args[0], fmt, s),))
    return model


def hf_greedy(model: nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def linears_of(target: TargetModel) -> dict[str, nn.Module]:
    return {name: m for name, m in target.hf.named_modules() if isinstance(m, nn.Linear)}


CASES = [("ct-static", "llama"), ("ct-dynamic", "llama"), ("ct-dynamic", "qwen2"), ("ct-block", "llama"),
         ("fine-grained", "llama"), ("fine-grained", "qwen2"), ("fbgemm", "llama"), ("fbgemm-ub", "qwen2"),
         ("modelopt", "llama")]


@pytest.mark.parametrize("name,arch", CASES)
def test_a_checkpoint_loads_as_the_stored_fp8_values_and_scales(name, arch, tmp_path):
    fmt, model = FORMATS[name], tiny_model(arch)
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    written = write_checkpoint(tmp_path, model, fmt)
    target = TargetModel.load(tmp_path, torch.float32, torch.device("cpu"))
    linears = linears_of(target)
    assert {n for n, m in linears.items() if isinstance(m, Fp8Linear)} == set(written)
    for n, (weight, scale, input_scale) in written.items():
        layer = linears[n]
        assert torch.equal(layer.weight.view(torch.uint8), weight.view(torch.uint8))
        assert torch.equal(layer.dequantized(), weight.float() * expand(scale, fmt, weight.shape))
        # E4M3 rounds to 3 mantissa bits (at most 2^-4 relative), subnormals to 2^-9 of the scale (2^-10 off)
        bound = originals[n].abs() * 2 ** -4 + expand(scale, fmt, weight.shape) * 2 ** -10
        assert ((layer.dequantized() - originals[n]).abs() <= bound).all()
        assert (layer.input_scale is None) == (input_scale is None)
        if input_scale is not None:
            assert layer.input_scale.item() == input_scale.item()
        assert layer.block_scales == (fmt.weights == "block") and layer.scale_ub == fmt.scale_ub
        if arch == "qwen2" and n.endswith(("q_proj", "k_proj", "v_proj")):
            assert torch.equal(layer.bias, model.get_submodule(n).bias)
    for n, m in linears.items():
        if n not in written:
            assert type(m) is nn.Linear and torch.equal(m.weight, originals[n]), n
    assert type(target.lm_head) is nn.Linear and target.lm_head.weight.dtype == torch.float32
    norms = [m for m in target.hf.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(m.weight.dtype == torch.float32 for m in norms)


@pytest.mark.parametrize("name,arch", CASES)
def test_greedy_decoding_is_the_checkpoint_maths(name, arch, tmp_path):
    fmt, model = FORMATS[name], tiny_model(arch)
    written = write_checkpoint(tmp_path, model, fmt)
    ref = reference(model, fmt, written)
    expected = hf_greedy(ref, PROMPT, MAX_NEW)
    with SpecModel.from_pretrained(str(tmp_path), None, dtype="float32", device="cpu", max_batch_size=1) as spec:
        out = spec.generate([PROMPT], SamplingParams(max_new_tokens=MAX_NEW, logprobs=1))[0]
    assert out.token_ids == expected
    assert_same_logprobs(out.logprobs, hf_logprobs(ref, PROMPT, expected))


def assert_same_logprobs(logprobs: list[float], expected: torch.Tensor) -> None:
    """A scheme read wrongly (static scales for dynamic ones, no clamp, channel scales for blocks) moves every row's
    logprob by 1e-2 or more; the float noise between the engine's and transformers' forwards (1e-7) stays below,
    unless it tips an activation across an FP8 rounding boundary, which moves one row."""
    error = (torch.tensor(logprobs) - expected).abs()
    assert error.median() < 1e-5 and error.max() < 0.1, error


def hf_logprobs(model: nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of each output token at its row (transformers' forward over prompt + output). [n] fp32."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def test_fused_qkv_with_different_static_input_scales_quantizes_with_the_largest(tmp_path):
    """One GEMM, one activation scale: the largest of q's, k's and v's (none of them clips). The fused model
    decodes as transformers does with that scale on all three; its next-token distributions differ from the stock
    modules' (each its own scale) by FP8 rounding alone: less than FP8 moves them from the fp32 model's."""
    fmt, model = FORMATS["ct-static"], tiny_model("llama")
    written = write_checkpoint(tmp_path, model, fmt, {"q_proj": 1.0, "k_proj": 1.1, "v_proj": 1.2})
    merged, largest = dict(written), []
    for i in range(model.config.num_hidden_layers):
        parts = [f"model.layers.{i}.self_attn.{p}" for p in ATTENTION[:3]]
        assert len({written[name][2].item() for name in parts}) == 3
        largest.append(max(written[name][2].item() for name in parts))
        merged |= {name: (*written[name][:2], torch.tensor(largest[-1])) for name in parts}
    with SpecModel.from_pretrained(str(tmp_path), None, dtype="float32", device="cpu", max_batch_size=4,
                                   use_fused_layers=False) as stock:
        assert stock.target.fused is None
        greedy = stock.generate([PROMPT], SamplingParams(max_new_tokens=MAX_NEW))[0].token_ids
        prefixes = [PROMPT + greedy[:j] for j in range(MAX_NEW)]  # the same contexts for both paths
        stock_tops = [o.top_logprobs[0] for o in stock.generate(prefixes, SamplingParams(max_new_tokens=1,
                                                                                          logprobs=20))]
    with SpecModel.from_pretrained(str(tmp_path), None, dtype="float32", device="cpu", max_batch_size=4) as spec:
        assert [layer.self_attn.qkv_proj.input_scale.item() for layer in spec.target.fused.layers] == largest
        out = spec.generate([PROMPT], SamplingParams(max_new_tokens=MAX_NEW, logprobs=1))[0]
        fused_tops = [o.top_logprobs[0] for o in spec.generate(prefixes, SamplingParams(max_new_tokens=1,
                                                                                         logprobs=20))]
    ref = reference(copy.deepcopy(model), fmt, merged)
    assert out.token_ids == hf_greedy(ref, PROMPT, MAX_NEW)
    assert_same_logprobs(out.logprobs, hf_logprobs(ref, PROMPT, out.token_ids))
    with torch.no_grad():
        exact = torch.log_softmax(model(torch.tensor([PROMPT + greedy])).logits[0, len(PROMPT) - 1:-1], -1)
    fused_error, fp8_error = [], []
    for token, row, stock_top, fused_top in zip(greedy, exact, stock_tops, fused_tops):
        assert token in fused_top
        fused_error += [abs(fused_top[t] - stock_top[t]) for t in stock_top.keys() & fused_top.keys()]
        fp8_error += [abs(row[t].item() - stock_top[t]) for t in stock_top]
    assert torch.tensor(fused_error).mean() < torch.tensor(fp8_error).mean()


REFUSED = {
    "nvfp4-pack-quantized": compressed_tensors(
        {"strategy": "tensor_group", "group_size": 16, "num_bits": 4, "dynamic": False},
        {"strategy": "tensor_group", "group_size": 16, "num_bits": 4, "dynamic": "local"}, "nvfp4-pack-quantized"),
    "int-quantized": compressed_tensors({"strategy": "channel", "type": "int", "dynamic": False},
                                        {"strategy": "token", "type": "int", "dynamic": True}, "int-quantized"),
    "weight-only FP8": compressed_tensors({"strategy": "channel", "dynamic": False}, None),
    "'awq'": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "'gptq'": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "'bitsandbytes'": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                       "bnb_4bit_compute_dtype": "bfloat16", "_load_in_4bit": True, "_load_in_8bit": False},
    "'NVFP4'": None,  # ModelOpt's hf_quant_config.json
}


@pytest.mark.parametrize("named", list(REFUSED))
def test_other_quantization_methods_are_refused_in_one_line_naming_them(named, tmp_path):
    config = tiny_model("llama").config
    if REFUSED[named] is None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "0.27.0"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}))
    else:
        config.quantization_config = REFUSED[named]
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedQuantization) as err:
        SpecModel.from_pretrained(str(tmp_path), None, dtype="float32", device="cpu")
    message = str(err.value)
    assert named in message and "\n" not in message and "not supported" in message


def test_modelopt_kv_cache_scales_reach_an_fp8_kv_cache(tmp_path):
    """ModelOpt stores each layer's FP8 KV-cache scales beside its projections: an FP8 cache takes them (the draft's
    layers, had it any, 1.0); a 16-bit cache stores values unscaled."""
    fmt, model = FORMATS["modelopt"], tiny_model("llama")
    write_checkpoint(tmp_path, model, fmt)
    layers = model.config.num_hidden_layers
    expected = (float(fmt.extra["k_proj.k_scale"]), float(fmt.extra["v_proj.v_scale"]))
    for kv_cache_dtype, scales in (("fp8", expected), ("auto", (1.0, 1.0))):
        with SpecModel.from_pretrained(str(tmp_path), None, dtype="float32", device="cpu", max_batch_size=1,
                                       kv_cache_dtype=kv_cache_dtype) as spec:
            assert spec.target.kv_scales == [expected] * layers
            assert [spec.runner.kv_cache.scales(i) for i in range(layers)] == [scales] * layers
            out = spec.generate([PROMPT], SamplingParams(max_new_tokens=MAX_NEW))[0]
            assert len(out.token_ids) == MAX_NEW


def test_fp8_mixture_of_experts_targets_are_refused_in_one_line(tmp_path):
    from tllm_spec.tools.random_models import shape_config

    config = shape_config("tiny-qwen3-moe")
    target = TargetModel.from_config(config, torch.float32, "cpu")
    with pytest.raises(NotImplementedError, match="^FP8 mixture-of-experts targets are not supported yet"):
        target.quantize("fp8")
    target.hf.save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="FP8 mixture-of-experts targets are not supported yet"):
        SpecModel.from_pretrained(str(tmp_path), None, dtype="float32", device="cpu", quantization="fp8")
