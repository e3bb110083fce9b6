"""Lossless greedy: speculative output == the target's own greedy output (HF generate), token for token."""
import pytest

from tllm_spec import SamplingParams
from tllm_spec.spec_model import SpecModel

from .models import eagle3, hf_greedy, tiny_pair

PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6, 7, 8, 9], [33, 34, 35, 36],
           [90, 1, 90, 1, 90]]
MAX_NEW = [14, 9, 17, 5, 12]  # requests finish at different steps


def check_lossless(target, model, prompts, max_new):
    params = [SamplingParams(max_new_tokens=n) for n in max_new]
    outs = model.generate(prompts, params)
    for prompt, n, out in zip(prompts, max_new, outs):
        assert out.token_ids == hf_greedy(target, prompt, n), f"prompt {prompt}"
        assert out.finish_reason == "length"
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_lossless_batch3(arch, k):
    target, head = tiny_pair(arch)
    model = SpecModel.from_pretrained(target, eagle3(head, k), max_batch_size=3)
    outs = check_lossless(target, model, PROMPTS[:3], MAX_NEW[:3])
    assert outs.stats["steps"] > 0


@pytest.mark.parametrize("batch", [1, 5])
def test_greedy_lossless_batch_sizes(batch):
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=batch)
    check_lossless(target, model, PROMPTS[:batch], MAX_NEW[:batch])


def test_more_requests_than_batch_slots_queue_up():
    target, head = tiny_pair("qwen2")
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2)
    check_lossless(target, model, PROMPTS, MAX_NEW)


def test_six_layer_target_with_the_default_capture_layers():
    target, head = tiny_pair("llama", num_layers=6)  # default capture layers (1, 2, 2)
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=5)
    assert model.target._capture_ids == (1, 2, 2)
    check_lossless(target, model, PROMPTS, MAX_NEW)


def test_reduced_draft_vocabulary():
    target, head = tiny_pair("llama", draft_vocab_size=32)
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=5)
    check_lossless(target, model, PROMPTS, MAX_NEW)


def test_plain_decoding_same_engine():
    target, _ = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, None, max_batch_size=5)
    outs = check_lossless(target, model, PROMPTS, MAX_NEW)
    assert outs.stats["mean_accepted_length"] == 1.0


def test_greedy_requests_unaffected_by_sampled_neighbours():
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=5)
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=1.0),
              SamplingParams(max_new_tokens=12, temperature=0.0, top_k=5),
              SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, top_k=20)]
    outs = model.generate(PROMPTS[:4], params, seed=3)
    assert outs[0].token_ids == hf_greedy(target, PROMPTS[0], 12)
    assert outs[2].token_ids == hf_greedy(target, PROMPTS[2], 12)
    assert len(outs[1].token_ids) == len(outs[3].token_ids) == 12


def test_stop_token_trims_accepted_tail():
    target, head = tiny_pair("llama")
    reference = hf_greedy(target, PROMPTS[0], 20)
    stop = reference[6]
    first = reference.index(stop)
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2)
    out = model.generate([PROMPTS[0]], SamplingParams(max_new_tokens=20, stop_token_ids=(stop,)))[0]
    assert out.token_ids == reference[:first + 1] and out.finish_reason == "stop"


def test_max_seq_len_stops_with_length():
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2, max_seq_len=16)
    out = model.generate([PROMPTS[0]], SamplingParams(max_new_tokens=50))[0]
    assert out.finish_reason == "length" and len(PROMPTS[0]) + len(out.token_ids) == 16
    assert out.token_ids == hf_greedy(target, PROMPTS[0], 16 - len(PROMPTS[0]))


def test_dense_prefill_attention_matches_paged_reference():
    """The GPU prefill path (dense causal attention, one call per run of equal prompt lengths) equals the paged
    reference on CPU."""
    import torch

    from tllm_spec.kernels.paged_attention import paged_attention_ref
    from tllm_spec.model.prompt_attention import prefill_attention

    torch.manual_seed(0)
    lens, hq, hkv, d, page = (5, 5, 1, 12, 12, 12, 5), 4, 2, 16, 4
    n, num = sum(lens), len(lens)
    q, k, v = torch.randn(n, hq, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    slots = torch.repeat_interleave(torch.arange(num), torch.tensor(lens))
    positions = torch.cat([torch.arange(m) for m in lens])
    block_tables = torch.arange(1, 4 * num + 1, dtype=torch.int32).view(num, 4)
    k_cache = torch.zeros(4 * num + 1, page, hkv, d)
    v_cache = torch.zeros_like(k_cache)
    index = block_tables[slots, positions // page].long() * page + positions % page
    k_cache.view(-1, hkv, d)[index] = k
    v_cache.view(-1, hkv, d)[index] = v
    for window in (None, 3):
        ref = paged_attention_ref(q, k_cache, v_cache, block_tables, slots, positions, 0.25, 16, window)
        torch.testing.assert_close(prefill_attention(q, k, v, lens, 0.25, window), ref)
