"""Top-1 agreement of a quantized target with its 16-bit original (scripts/eval_acceptance.py --quantization)."""
import copy

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tllm_spec.model.quant.linear import quantize_linears
from tllm_spec.tools.quant_agreement import quantized_agreement, top1_agreement


def _tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_a_model_agrees_with_itself_and_a_quantized_copy_counts_its_flips():
    model = _tiny_llama()
    sequences = [torch.randint(0, 97, (24,)).tolist() for _ in range(3)]
    same = top1_agreement(model, model, sequences)
    assert same == {"positions": 72, "agreement": 1.0, "mean_abs_logprob_diff": 0.0}
    quantized = copy.deepcopy(model)
    quantize_linears(quantized)
    result = top1_agreement(model, quantized, sequences)
    assert 0.5 < result["agreement"] <= 1.0 and result["mean_abs_logprob_diff"] > 0


def test_the_demo_target_in_fp8():
    result = quantized_agreement("demo://target", "fp8", num_texts=2, tokens=64)
    assert result["positions"] == 128 and 0.8 < result["agreement"] <= 1.0
