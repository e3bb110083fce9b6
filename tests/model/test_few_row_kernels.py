"""The few-row path (RMSNorms as their own op, residual adds and the SwiGLU product as GEMM epilogues: what a
generation step of at most 32 rows runs on the GPU, 64 in a block of FP8 projections) keeps greedy decoding
lossless. The rule is forced on here: on the CPU ``layers.linear`` and the norm op compute the same results with the
stock ops, so these tests check the fused layers' wiring (target, EAGLE-3 and MTP layers: which residual is added
where, which norm feeds which GEMM); the kernels are checked against their references in ``tests/kernels`` and
``tests/gpu``."""
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from tllm_spec import MTPConfig, SamplingParams
from tllm_spec.drafts.eagle3 import model as eagle3_module
from tllm_spec.kernels.fp8_linear import MAX_ROWS as FP8_MAX_ROWS
from tllm_spec.kernels.skinny_linear import MAX_ROWS
from tllm_spec.model import layers
from tllm_spec.model.quant.linear import Fp8Linear
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.random_models import save_random_target, target_config

from ..models import ARCH_OVERRIDES, eagle3, tiny_pair
from ..test_lossless import MAX_NEW, PROMPTS, check_lossless
from ..test_mtp_lossless import mtp_target


@pytest.fixture
def forced_rule(monkeypatch):
    """Every layer takes the few-row path; the list records the row counts of the layers that asked."""
    calls = []

    def always(x, attn, max_rows=None):
        calls.append(x.shape[0])
        return True
    monkeypatch.setattr(layers, "few_row_kernels", always)
    monkeypatch.setattr(eagle3_module, "few_row_kernels", always)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_target_and_eagle3_layers_are_lossless(arch, forced_rule):
    target, head = tiny_pair(arch)
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=3)
    check_lossless(target, model, PROMPTS[:3], MAX_NEW[:3])
    assert 1 in forced_rule  # the draft passes of one request asked too


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_midlayer_drafts_the_same_on_both_paths(norm_before_residual, monkeypatch):
    """Lossless decoding hides a draft head's mistakes, so the drafts are compared directly: with the rule
    forced on, the head proposes exactly what it proposes on the stock path at every step, for both residual
    conventions of the midlayer (sharp attention, so a wrong residual or norm changes the proposals)."""
    target, head = tiny_pair("llama", head_scale=12.0)
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=3)
    model.worker.draft_model.midlayer.norm_before_residual = norm_before_residual
    original = model.worker.draft

    def proposals() -> list:
        seen = []

        def recording(*args):
            drafts = original(*args)
            seen.append(drafts.tolist())
            return drafts
        model.worker.draft = recording
        model.generate(PROMPTS[:3], [SamplingParams(max_new_tokens=n) for n in MAX_NEW[:3]])
        return seen
    stock = proposals()
    monkeypatch.setattr(eagle3_module, "few_row_kernels", lambda x, attn: True)
    assert proposals() == stock and len(stock) >= 5


def _target_with_random_norms(path, arch: str, **overrides):
    """A tiny random ``arch`` target whose RMSNorm weights are random too (the stock init leaves them ones, which
    would hide a norm given another's weight)."""
    config = target_config(arch, vocab_size=97, num_hidden_layers=3, **{**ARCH_OVERRIDES[arch], **overrides})
    target = save_random_target(path, config, seed=3)
    model = AutoModelForCausalLM.from_pretrained(target)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=g))
    model.save_pretrained(target)
    return target


@pytest.mark.parametrize("arch,overrides,kind", [
    ("glm4_moe", {"use_qk_norm": False}, "the q|k|v GEMM's rotary epilogue, half of each head"),
    ("glm4_moe", {}, "q/k norms and half of each head rotated in one kernel"),
    ("qwen3", {}, "q/k norms and the rotation in one kernel")])
def test_q_and_k_norms_and_rotations_on_the_few_row_path_are_lossless(arch, overrides, kind, forced_rule,
                                                                      monkeypatch, tmp_path):
    """GLM-4.5-Air's attention (biases, half of each head rotated, no q/k norm) asks its q|k|v GEMM for the
    rotation, per head of head_dim; GLM-4.5's and Qwen3's (q/k norms) run the norms and the rotation as one op
    (kernels/qk_norm_rotary.py): lossless, so each path rotates and normalises what the stock layer does."""
    target = _target_with_random_norms(tmp_path / arch, arch, **overrides)
    asked = []
    for name in ("linear", "qk_norm_rotary_ref"):
        original = getattr(layers, name)

        def recording(*args, _original=original, _name=name, **kwargs):
            if _name != "linear" or kwargs.get("rotary_cols"):
                asked.append((_name, kwargs.get("head_dim")))
            return _original(*args, **kwargs)
        monkeypatch.setattr(layers, name, recording)
    model = SpecModel.from_pretrained(target, None, max_batch_size=2)
    check_lossless(target, model, PROMPTS[:2], MAX_NEW[:2])
    expected = ("linear", ARCH_OVERRIDES[arch]["head_dim"]) if "epilogue" in kind else ("qk_norm_rotary_ref", None)
    assert forced_rule and set(asked) == {expected}


def test_an_fp8_target_with_q_and_k_norms_decodes_on_the_few_row_path_as_on_the_stock_one(monkeypatch, tmp_path):
    """An FP8 Qwen3 target (quantized at load): its norms hand the q|k|v projection FP8 rows, whose result the q/k
    norm op takes. On the CPU both paths are the same reference ops, so the tokens are the same."""
    target = _target_with_random_norms(tmp_path / "qwen3", "qwen3")
    params = [SamplingParams(max_new_tokens=n) for n in MAX_NEW[:2]]

    def tokens() -> list:
        with SpecModel.from_pretrained(target, None, quantization="fp8", max_batch_size=2) as model:
            return [out.token_ids for out in model.generate(PROMPTS[:2], params)]
    stock = tokens()
    monkeypatch.setattr(layers, "few_row_kernels", lambda x, attn, max_rows=MAX_ROWS: True)
    asked = []
    original = layers.qk_norm_rotary_ref
    monkeypatch.setattr(layers, "qk_norm_rotary_ref", lambda *args: asked.append(args[0].shape) or original(*args))
    assert tokens() == stock and asked


def test_mtp_layers_are_lossless(forced_rule):
    target = mtp_target("llama", "deepseek")
    model = SpecModel.from_pretrained(target, MTPConfig(num_nextn_predict_layers=1, max_draft_len=3),
                                      max_batch_size=2)
    check_lossless(target, model, PROMPTS[:2], MAX_NEW[:2])
    assert forced_rule


def test_the_rule_takes_generation_steps_of_few_rows_in_half_precision_on_cuda():
    def tensor(rows, dtype=torch.bfloat16, cuda=True):  # the rule reads only these attributes
        return SimpleNamespace(is_cuda=cuda, dtype=dtype, shape=(rows, 4096))

    def meta(tokens_per_request, context_lens=()):
        return SimpleNamespace(tokens_per_request=tokens_per_request, context_lens=context_lens)
    assert layers.few_row_kernels(tensor(4), meta(4))  # one request's verify rows
    assert layers.few_row_kernels(tensor(1, torch.float16), meta(1))  # one request's draft pass
    assert layers.few_row_kernels(tensor(8), meta(4))  # two requests
    assert layers.few_row_kernels(tensor(32), meta(4))  # eight requests' chains of three drafts
    assert not layers.few_row_kernels(tensor(36), meta(4))  # nine: more rows than the kernel takes
    assert not layers.few_row_kernels(tensor(4, torch.float32), meta(4))  # fp32 keeps the stock ops
    assert not layers.few_row_kernels(tensor(4, cuda=False), meta(4))
    assert layers.few_row_kernels(tensor(26), meta(26))  # one request's default draft tree
    assert not layers.few_row_kernels(tensor(52), meta(26))  # two requests' trees
    assert not layers.few_row_kernels(tensor(3), meta(4, context_lens=(3,)))  # a prompt
    assert layers.few_row_kernels(tensor(64), meta(4), max_rows=64)  # an FP8 block: sixteen requests' chains
    assert not layers.few_row_kernels(tensor(68), meta(4), max_rows=64)


def test_a_block_of_fp8_projections_takes_the_few_row_path_up_to_the_fp8_kernels_bound():
    bf16 = torch.nn.Linear(64, 32, bias=False)
    fp8 = Fp8Linear.quantize(bf16)
    static = Fp8Linear(fp8.weight.detach(), fp8.weight_scale, input_scale=torch.tensor([0.1]))
    assert layers.fp8_rows(fp8, fp8, fp8, fp8) == FP8_MAX_ROWS == 64
    assert layers.fp8_rows(fp8, fp8, fp8, bf16) == layers.fp8_rows(fp8, fp8, None, None) == MAX_ROWS == 32
    assert layers.fp8_rows(fp8, static, fp8, fp8) == MAX_ROWS  # a static activation scale: no FP8 norm rows
