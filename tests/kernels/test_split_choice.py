"""How many KV splits, and how many query rows per program, the attention launcher picks (host decisions, fixed
per step or captured graph)."""
import torch

from tllm_spec.kernels.attention_merge import split_geometry_ref
from tllm_spec.kernels.attention_plan import wave_splits
from tllm_spec.kernels.paged_attention import MAX_SPLITS, choose_num_splits, choose_program_rows


def test_runs_that_fill_the_gpu_are_not_split():
    assert choose_num_splits(num_programs=64 * 8, max_kv_len=131072, num_sms=132) == 1


def test_short_contexts_are_not_split_below_the_minimum_chunk():
    assert choose_num_splits(num_programs=8, max_kv_len=200, num_sms=132) == 1
    assert choose_num_splits(num_programs=8, max_kv_len=511, num_sms=132) == 1  # under two chunks: one split
    assert choose_num_splits(num_programs=8, max_kv_len=512, num_sms=132) == 2
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


def test_a_tree_run_takes_small_row_blocks_while_they_fit_one_wave():
    # a 32-token tree x 4 query heads = 128 rows a (request, KV head): batch 1 (8 pairs) in blocks of 16 rows
    # (64 programs); batch 8 (64 pairs) in blocks of 32 (256 programs: 16-row blocks would make 512)
    assert choose_program_rows(run_rows=128, num_programs=8, num_sms=132) == 16
    assert choose_program_rows(run_rows=128, num_programs=64, num_sms=132) == 32
    assert choose_program_rows(run_rows=128, num_programs=512, num_sms=132) == 32
    assert choose_program_rows(run_rows=16, num_programs=512, num_sms=132) == 16  # a chain: one block either way


def test_runs_under_two_minimum_chunks_are_not_split():
    # chunks of 256 keys (4 splits asked, at least 256 keys a chunk): 300 keys stay one chunk, not 256 + 44;
    # from 512 keys on, chunks of 256 and a last one with the rest
    positions = torch.tensor([299, 510, 511, 766, 1000])  # 300, 511, 512, 767 and 1,001 keys
    _, chunk, used = split_geometry_ref(positions, 1, 0, 4, 256, 128)
    assert chunk.tolist() == [256] * 5 and used.tolist() == [1, 1, 2, 3, 4]


def test_a_run_splits_by_its_own_length_not_the_launch_bound():
    # a graph sized for 128k keys at batch 1 (8 programs on 132 SMs: a grid of 64 splits, 33 fill a wave) splits a
    # 2k run in 8 chunks of 256; an 8k run in 32 of 256 (33 splits would leave 249-key chunks, raised to the
    # 256-key minimum); a 32k run in 32 of 1024 (33 splits leave 993-key chunks, rounded up to blocks); a 128k run
    # in 64 of 2048 (its chunks would pass 2048 keys at 33)
    positions = torch.tensor([2047, 8191, 32767, 131071])
    _, chunk, used = split_geometry_ref(positions, 1, 0, 64, 256, 128, wave_splits=33, max_chunk=2048)
    assert chunk.tolist() == [256, 256, 1024, 2048] and used.tolist() == [8, 32, 32, 64]
    # batch 8 (64 programs: 4 fill a wave): 8k in 4 chunks of 2048, 32k in 16 of 2048
    _, chunk, used = split_geometry_ref(torch.tensor([8191, 32767]), 1, 0, 64, 256, 128, wave_splits=4,
                                        max_chunk=2048)
    assert chunk.tolist() == [2048, 2048] and used.tolist() == [4, 16]
    assert wave_splits(num_programs=8, num_sms=132) == 33 and wave_splits(num_programs=64, num_sms=132) == 4
    assert wave_splits(num_programs=512, num_sms=132) == 1


def test_the_split_grid_stays_within_a_few_waves():
    # batch 8 (64 programs, 4 splits a wave): a 128k bound asks for 64 chunks of 2048 keys, the grid takes 16
    assert choose_num_splits(num_programs=64, max_kv_len=131072, num_sms=132) == 16
    assert choose_num_splits(num_programs=8, max_kv_len=131072, num_sms=132) == 64  # batch 1: 33 a wave
