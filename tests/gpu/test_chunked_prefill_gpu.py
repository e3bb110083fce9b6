"""Chunked prefill on the GPU: a later chunk's attention over the cached prefix (its own keys and the prefix's by
two fused calls merged by log-sum-exp, or SDPA with a lower-right causal bias) against the paged reference, and
greedy decoding with small chunks equal to HF greedy."""
import pytest
import torch

from tllm_spec import SamplingParams, SpecModel
from tllm_spec.kernels.paged_attention import paged_attention_ref
from tllm_spec.model.prompt_attention import cached_prefix_attention, prefill_attention, varlen_causal_attention

from ..models import eagle3, hf_greedy, tiny_pair

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("start,n", [(16, 40), (8190, 2049), (30000, 2800)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("split", [None, False])  # the default (split by log-sum-exp in bf16), the lower-right bias
def test_cached_prefix_attention_matches_reference(start, n, dtype, split):
    torch.manual_seed(start + n)
    page, hq, hkv, d = 16, 32, 8, 128
    pages = -(-(start + n) // page)
    k_cache = torch.randn(pages + 3, page, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    block_table = (torch.randperm(pages + 2, device="cuda")[:pages] + 1).int()[None]
    q = torch.randn(n, hq, d, device="cuda", dtype=dtype)
    positions = torch.arange(start, start + n, device="cuda")
    slots = torch.zeros(n, dtype=torch.int64, device="cuda")
    out = cached_prefix_attention(q, k_cache, v_cache, block_table, start, d ** -0.5, split=split)
    ref = paged_attention_ref(q, k_cache, v_cache, block_table, slots, positions, d ** -0.5, start + n)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_attention_of_a_batch_matches_reference(dtype, window):
    """A prompt step's attention over prompts of mixed and equal lengths (one varlen flash call in bf16 where
    torch has it, SDPA per run of equal lengths otherwise) against the paged reference."""
    torch.manual_seed(1)
    lens, page, hq, hkv, d = (1, 37, 128, 128, 300, 64), 16, 32, 8, 128
    n, num = sum(lens), len(lens)
    q = torch.randn(n, hq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(n, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
    slots = torch.repeat_interleave(torch.arange(num, device="cuda"), torch.tensor(lens, device="cuda"))
    positions = torch.cat([torch.arange(m, device="cuda") for m in lens])
    per_request = -(-max(lens) // page)
    block_tables = torch.arange(1, num * per_request + 1, dtype=torch.int32, device="cuda").view(num, per_request)
    k_cache = torch.zeros(num * per_request + 1, page, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    index = block_tables[slots, positions // page].long() * page + positions % page
    k_cache.view(-1, hkv, d)[index] = k
    v_cache.view(-1, hkv, d)[index] = v
    ref = paged_attention_ref(q, k_cache, v_cache, block_tables, slots, positions, d ** -0.5, max(lens), window)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(prefill_attention(q, k, v, lens, d ** -0.5, window).float(), ref.float(),
                               atol=tol, rtol=tol)
    if dtype == torch.bfloat16:
        varlen = varlen_causal_attention(q, k, v, lens, d ** -0.5, window)
        print("varlen_attn:", "used" if varlen is not None else "unavailable in this torch")
        if varlen is not None:
            torch.testing.assert_close(varlen.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_greedy_is_lossless_fp32(chunk):
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, eagle3(head, 3), dtype=torch.float32, device="cuda", max_batch_size=4,
                                      max_num_batched_tokens=chunk, compile_step=False)
    prompts = [list(range(3, 60)), [5, 9, 2], list(range(40, 17, -1))]
    params = [SamplingParams(max_new_tokens=n) for n in (20, 25, 16)]
    for p, sp, out in zip(prompts, params, model.generate(prompts, params)):
        assert out.token_ids == hf_greedy(target, p, sp.max_new_tokens)


@pytest.mark.parametrize("lens,starts", [((40,), (16,)), ((7, 300, 33), (4096, 0, 9000)), ((144,) * 16, (4080,) * 16)])
def test_chunks_over_cache_attention_matches_reference(lens, starts):
    """Every chunk in one varlen flash call over keys gathered from its pages, against the paged reference."""
    from tllm_spec.model.prompt_attention import chunks_over_cache_attention

    torch.manual_seed(sum(lens))
    page, hq, hkv, d, dtype = 16, 32, 8, 128, torch.bfloat16
    per_request = -(-max(s + n for s, n in zip(starts, lens)) // page)
    num = len(lens)
    block_tables = (torch.randperm(num * per_request, device="cuda") + 1).int().view(num, per_request).contiguous()
    k_cache = torch.randn(num * per_request + 1, page, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(lens), hq, d, device="cuda", dtype=dtype)
    slots = torch.cat([torch.full((n,), i, device="cuda") for i, n in enumerate(lens)])
    positions = torch.cat([torch.arange(s, s + n, device="cuda") for s, n in zip(starts, lens)])
    out = chunks_over_cache_attention(q, k_cache, v_cache, block_tables, torch.arange(num, device="cuda"), lens,
                                      starts, d ** -0.5)
    if out is None:
        pytest.skip("this torch has no varlen_attn")
    ref = paged_attention_ref(q, k_cache, v_cache, block_tables, slots, positions, d ** -0.5,
                              max(s + n for s, n in zip(starts, lens)))
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
