"""How many KV splits the attention launcher picks (a host decision, fixed per step or captured graph)."""
from tllm_spec.kernels.paged_attention import MAX_SPLITS, choose_num_splits


def test_runs_that_fill_the_gpu_are_not_split():
    assert choose_num_splits(num_programs=64 * 8, max_kv_len=131072, num_sms=132) == 1


def test_short_contexts_are_not_split_below_the_minimum_chunk():
    assert choose_num_splits(num_programs=8, max_kv_len=200, num_sms=132) == 1
    assert choose_num_splits(num_programs=8, max_kv_len=1024, num_sms=132) == 4


def test_one_request_gets_two_programs_per_sm():
    assert choose_num_splits(num_programs=8, max_kv_len=32768, num_sms=132) == 33


def test_long_contexts_keep_chunks_short_until_the_cap():
    assert choose_num_splits(num_programs=64, max_kv_len=32768, num_sms=132) == 16
    assert choose_num_splits(num_programs=8, max_kv_len=1 << 20, num_sms=132) == MAX_SPLITS


def test_splits_fill_one_wave_of_programs_not_two():
    # batch 8 x 8 KV heads on 132 SMs: 4 splits are 256 programs (one wave of two per SM); 5 would be 320
    assert choose_num_splits(num_programs=64, max_kv_len=8192, num_sms=132) == 4
    assert choose_num_splits(num_programs=64, max_kv_len=2048, num_sms=132) == 4
