import torch

from tllm_spec import SamplingParams, SpecMetadata


def test_flat_rows_and_sentinels():
    meta = SpecMetadata(max_num_requests=4, max_draft_len=2, vocab_size=100, device="cpu")
    params = [SamplingParams(temperature=0.8, top_k=0),          # context, sampled, top-k disabled
              SamplingParams(),                                   # generation, greedy
              SamplingParams(temperature=1.2, top_k=500, top_p=0.9)]  # generation, top-k above vocab
    addr = meta.temperatures.data_ptr()
    meta.prepare(params, context_lens=[5])
    temps, top_ks, top_ps = meta.rows()
    assert meta.num_rows == 1 + 2 * 3
    assert temps.tolist() == [0.800000011920929] + [1.0] * 3 + [1.2000000476837158] * 3
    assert top_ks.tolist() == [100, 1, 1, 1, 100, 100, 100]
    assert torch.allclose(top_ps, torch.tensor([1.0, 1, 1, 1, 0.9, 0.9, 0.9]))
    assert meta.gather_ids[:7].tolist() == [4, 5, 6, 7, 8, 9, 10]
    assert meta.temperatures.data_ptr() == addr  # filled in place: stable addresses for CUDA graphs


def test_gather_ids_two_contexts():
    meta = SpecMetadata(4, 3, 10, "cpu")
    meta.prepare([SamplingParams()] * 3, context_lens=[3, 2])
    assert meta.gather_ids[:meta.num_rows].tolist() == [2, 4, 5, 6, 7, 8]


def test_top_k_one_is_greedy():
    assert SamplingParams(temperature=1.0, top_k=1).is_greedy
    assert not SamplingParams(temperature=1.0).is_greedy
