"""How a paged-attention launch is shaped, decided on the host when a step is built or a CUDA graph captured: the
KV splits of each run (split-KV where the (run, KV head) programs do not fill the GPU) and the query rows a program
takes (a draft tree's run is cut into row blocks). Both are runtime arguments of the kernels, so a new choice
compiles nothing. The program's tile (keys per iteration, warps) is a compile-time choice of the kernel
(:func:`attention_tile`)."""
from __future__ import annotations

import torch

from .attention_merge import MAX_SPLITS

MIN_KEYS_PER_SPLIT = 256  # a chunk shorter than this costs more in merging than it saves
MAX_KEYS_PER_SPLIT = 2048
PROGRAM_ROWS = (16, 32)  # query rows a program may take: a wider run (a draft tree's) is cut into row blocks
PROGRAMS_PER_SM = 2  # two programs per SM hide each other's memory latency
BLOCK_N = 128  # keys per loop iteration of a program with few query rows (attention_tile)
NUM_WARPS = 4
WIDE_ROWS = 64  # from this many query rows a program (a draft tree's run) takes WIDE_TILE
WIDE_TILE = (64, 8)  # (keys per iteration, warps): its score and output tiles stay in registers
MAX_GRID_WAVES = 4  # a launch's split grid covers at most this many waves: the programs of splits a short run
# does not use still take an SM slot each (batch 8, 2k keys: an EAGLE-3 step took 8.18 ms in a grid of 64 splits,
# sized for a 128k bound, and 6.93 ms in one of 17, for 32k; two H200 runs, scripts/benchmark.py --context)


def wave_splits(num_programs: int, num_sms: int) -> int:
    """Splits per run that fill one wave of PROGRAMS_PER_SM programs per SM with ``num_programs`` (run, KV head)
    programs (rounded down: a few programs over it make a second wave; at batch 8 and 8k keys, 5 splits took
    100 µs where 4 took 77, scripts/sweep_splits.py). The kernels split each run by this count, more where its
    chunks would pass MAX_KEYS_PER_SPLIT keys, so a CUDA graph sized for a long bound splits a short run as a
    launch for that run alone would."""
    return max(1, PROGRAMS_PER_SM * num_sms // num_programs)


def choose_num_splits(num_programs: int, max_kv_len: int, num_sms: int) -> int:
    """KV splits per run (the launch's grid) where the (request run, KV head) programs do not fill the GPU: enough
    for PROGRAMS_PER_SM per SM (:func:`wave_splits`), and chunks of at most MAX_KEYS_PER_SPLIT keys at the longest
    context ``max_kv_len`` (more programs in flight pay at long context) within MAX_GRID_WAVES waves, none shorter
    than MIN_KEYS_PER_SPLIT, and no split at all for a bound under two of those (:mod:`.attention_merge` never
    splits a run that short). Measured on an H200 (bf16, 8 KV heads, verify runs of 4): 3.1 TB/s at batch 1 and
    32k keys, 3.9 at 128k; at batch 8 and 32k, 16 splits read 3.9 TB/s where 5 read 3.0."""
    if num_programs >= num_sms:
        return 1
    wave = wave_splits(num_programs, num_sms)
    wanted = min(max(wave, -(-max_kv_len // MAX_KEYS_PER_SPLIT)), MAX_GRID_WAVES * wave)
    return max(1, min(wanted, MAX_SPLITS, max_kv_len // MIN_KEYS_PER_SPLIT))  # under 2 chunks: never split


def choose_program_rows(run_rows: int, num_programs: int, num_sms: int) -> int:
    """Query rows per program for runs of ``run_rows`` rows over ``num_programs`` (run, KV head) pairs: the
    smallest of PROGRAM_ROWS whose row blocks still fit one wave of PROGRAMS_PER_SM programs per SM, else the
    largest. Measured on an H200 (draft tree of 32 tokens, 4 query heads per KV head, 256 keys): at batch 1 a
    call takes 10.0-10.1 us in blocks of 16 rows, 14.5 in blocks of 32 and 23.4 in one program of 128; at batch 8,
    27.9, 20.7 and 25.1 us (``scripts/sweep_splits.py --program-rows``)."""
    for rows in PROGRAM_ROWS:
        if run_rows <= rows or num_programs * -(-run_rows // rows) <= PROGRAMS_PER_SM * num_sms:
            return rows
    return PROGRAM_ROWS[-1]


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere, e.g. the interpreter: no split unless asked)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def attention_tile(rows_pad: int) -> tuple[int, int]:
    """(keys per iteration, warps) of a program with ``rows_pad`` query rows (query tokens x the query heads of
    one KV head, padded): BLOCK_N keys and NUM_WARPS warps for a chain's few rows; from WIDE_ROWS (a draft
    tree's 26 tokens x 4 heads pad to 128) fewer keys and more warps, where 128 x 128 fp32 score and output
    tiles on four warps would spill registers."""
    if rows_pad < WIDE_ROWS:
        return BLOCK_N, NUM_WARPS
    return min(BLOCK_N, WIDE_TILE[0]), WIDE_TILE[1]
