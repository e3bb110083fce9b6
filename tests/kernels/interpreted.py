"""Kernel-vs-reference cases run under Triton's CPU interpreter (TRITON_INTERPRET=1, set by the caller before
triton is imported): the Triton kernels' logic is checked on machines without a GPU. Prints one line per case."""
from __future__ import annotations

import itertools
import sys
import threading
from pathlib import Path

import torch

from tllm_spec import kernels
from tllm_spec.distributed import lamport
from tllm_spec.kernels import attention_merge as merge_module
from tllm_spec.kernels import attention_plan as plan_module
from tllm_spec.kernels import fused_moe as moe_module
from tllm_spec.kernels import kv_write as kv_write_module
from tllm_spec.kernels import moe_align as align_module
from tllm_spec.kernels import moe_topk as topk_module
from tllm_spec.kernels import move_rows as move_rows_module
from tllm_spec.kernels import paged_attention as attention_module
from tllm_spec.kernels import qk_norm_rotary as qk_norm_module
from tllm_spec.kernels import router_logits as router_module
from tllm_spec.kernels import rms_norm as rms_norm_module
from tllm_spec.kernels import rotary as rotary_module
from tllm_spec.kernels import silu_mul as silu_mul_module
from tllm_spec.kernels import skinny_linear as skinny_module
from tllm_spec.kernels import uniform as uniform_module
from tllm_spec.model.rotary import apply_rotary

from .launches import Launch, recording, save

kernels.runs_kernel = lambda t: True  # the launchers take the kernel path for CPU tensors


def _paged_case(query_len: int, num_runs: int, hq: int, hkv: int, window: int | None, fused_write: bool,
                num_splits: int | None = 1, max_pages: int = 6, tree: bool = False, program_rows: int | None = None,
                start: int | None = None) -> None:
    """One launch against the reference: random caches, pages and queries; each run's first position random, or
    ``start`` for every run."""
    g = torch.Generator().manual_seed(query_len * 31 + num_runs + hq + (num_splits or 0))
    page, d = 4, 16
    num_pages = num_runs * max_pages + 6
    k_cache = torch.randn(num_pages, page, hkv, d, generator=g)
    v_cache = torch.randn(num_pages, page, hkv, d, generator=g)
    block_tables = (torch.randperm(num_pages - 1, generator=g)[:num_runs * max_pages] + 1).int()
    block_tables = block_tables.view(num_runs, max_pages)
    starts = torch.randint(0, max_pages * page - query_len, (num_runs,), generator=g)
    if start is not None:
        starts = torch.full((num_runs,), start)
    positions = (starts[:, None] + torch.arange(query_len)).flatten()
    slots = torch.arange(num_runs).repeat_interleave(query_len)
    q = torch.randn(num_runs * query_len, hq + hkv, d, generator=g)[:, :hq]  # a slice of q|k: tokens strided
    new_kv = (torch.randn(len(q), hkv, d, generator=g), torch.randn(len(q), hkv, d, generator=g))
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    args = (block_tables, slots, positions, d ** -0.5, max_pages * page, window)
    # a draft tree's masks: random visibility of the 63 keys below each token, itself always (bit 0)
    tree_mask = torch.randint(0, 2 ** 62, (len(q),), generator=g) | 1 if tree else None
    if fused_write:
        out = attention_module.paged_attention(q, *caches[0], *args, query_len=query_len, new_kv=new_kv,
                                               num_splits=num_splits, tree_mask=tree_mask, program_rows=program_rows)
    else:
        kv_write_module.kv_write(*new_kv, *caches[0], block_tables, slots, positions)
        out = attention_module.paged_attention(q, *caches[0], *args, query_len=query_len, num_splits=num_splits,
                                               tree_mask=tree_mask, program_rows=program_rows)
    kv_write_module.kv_write_ref(*new_kv, *caches[1], block_tables, slots, positions)
    ref = attention_module.paged_attention_ref(q, *caches[1], *args, tree_mask=tree_mask)
    torch.testing.assert_close(caches[0][0], caches[1][0], rtol=0, atol=0)
    torch.testing.assert_close(caches[0][1], caches[1][1], rtol=0, atol=0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _split_cases() -> None:
    """Split-KV: keys cut into chunks of 16 (one key block), so runs of up to 160 keys use 1..num_splits splits,
    each split writing the new K/V that falls in it; the merge combines them."""
    attention_module.BLOCK_N = attention_module.MIN_KEYS_PER_SPLIT = 16
    try:
        grid = itertools.product([1, 4], [1, 3], [(4, 2), (3, 3)], [None, 21], [False, True], [2, 5])
        for query_len, num_runs, (hq, hkv), window, fused, splits in grid:
            _paged_case(query_len, num_runs, hq, hkv, window, fused, splits, max_pages=40)
            print(f"ok split paged_attention query_len={query_len} runs={num_runs} hq={hq} hkv={hkv} "
                  f"window={window} fused_write={fused} splits={splits}")
        for query_len, fused, splits in itertools.product([1, 8, 25], [False, True], [1, 3]):  # a verify step's tree
            _paged_case(query_len, 2, 4, 2, None, fused, splits, max_pages=40, tree=True)  # 25 x 2 rows: 2 blocks
            print(f"ok tree paged_attention query_len={query_len} fused_write={fused} splits={splits}")
        for fused in (False, True):  # 25 tokens from position 10: 35 keys, 3 chunks; the first row block's own
            # tokens see 26 keys (under two chunks): only the run's geometry gives every block and the merge one
            _paged_case(25, 1, 4, 2, None, fused, 3, max_pages=40, tree=True, start=10)
            print(f"ok pinned tree paged_attention fused_write={fused}")
        _auto_split_cases()
    finally:
        attention_module.BLOCK_N, attention_module.MIN_KEYS_PER_SPLIT = 128, 256
    for fused, splits, rows in itertools.product([False, True], [1, 2], [16, None, 128]):  # 26 tokens x 4 heads
        # in row blocks (of 16, of the kernel's choice: 32 here), or all 104 rows in one program (the wide tile);
        # from position 590: 616 keys, 2 chunks where 2 splits are asked
        _paged_case(26, 2, 8, 2, None, fused, splits, max_pages=160, tree=True, program_rows=rows, start=590)
        print(f"ok wide tree paged_attention rows={rows} fused_write={fused} splits={splits}")
    for query_len, window, wave in itertools.product([1, 3], [0, 9], [None, 2]):
        _merge_case(query_len, window, wave)
        print(f"ok merge_splits query_len={query_len} window={window} wave_splits={wave}")


def _auto_split_cases() -> None:
    """The launch's own split choice on an 8-SM device, chunks of 16 to 32 keys: 3 runs x 2 KV heads fill a wave
    with 2 splits, so the grid for the 160-key bound is 5 splits, of which each run uses 2 (more where its chunks
    would pass 32 keys: 4 of 16 keys without that choice at 60 keys) up to 5; the attention and the merge must agree
    on each run's count."""
    saved = attention_module.num_sms, attention_module.MAX_KEYS_PER_SPLIT, plan_module.MAX_KEYS_PER_SPLIT, \
        plan_module.MIN_KEYS_PER_SPLIT
    attention_module.num_sms = lambda device: 8
    attention_module.MAX_KEYS_PER_SPLIT = plan_module.MAX_KEYS_PER_SPLIT = 32
    plan_module.MIN_KEYS_PER_SPLIT = 16
    try:
        for query_len, window, fused in itertools.product([1, 4], [None, 21], [False, True]):
            _paged_case(query_len, 3, 4, 2, window, fused, None, max_pages=40)
            print(f"ok auto split paged_attention query_len={query_len} window={window} fused_write={fused}")
    finally:
        attention_module.num_sms, attention_module.MAX_KEYS_PER_SPLIT, plan_module.MAX_KEYS_PER_SPLIT, \
            plan_module.MIN_KEYS_PER_SPLIT = saved


def _merge_case(query_len: int, window: int, wave: int | None) -> None:
    """The merge kernel against its reference on random partials: splits a run does not use hold garbage, and
    rows that saw no key in a split carry (-inf, 0). ``wave``: runs split in 2 (more past 3 blocks a chunk) of the
    4 the launch has, by their own length; else in all 4."""
    g = torch.Generator().manual_seed(query_len + window)
    num_splits, num_tokens, hq, d = 4, 5 * query_len, 6, 16
    block = 4 if window else 16  # a window leaves a run few keys: small chunks still split it
    positions = torch.randint(0, 200, (num_tokens // query_len,), generator=g).repeat_interleave(query_len)
    positions += torch.arange(query_len).repeat(num_tokens // query_len)
    positions[:query_len] -= positions[0] - 2  # a run of one chunk: finished by its first split
    part_acc = torch.randn(num_splits, num_tokens, hq, d, generator=g)
    part_ml = torch.randn(num_splits, num_tokens, hq, 2, generator=g).abs()
    part_ml[1, :, 0] = torch.tensor([float("-inf"), 0.0])
    outs = [torch.full((num_tokens, hq, d), 7.0) for _ in range(2)]
    geometry = {"wave_splits": wave, "max_chunk": 3 * block} if wave else {}
    args = (positions, query_len, window, block, block)
    merge_module.merge_splits(part_acc, part_ml, *args[:1], outs[0], *args[1:], **geometry)
    merge_module.merge_splits_ref(part_acc, part_ml, *args[:1], outs[1], *args[1:], **geometry)
    _, _, used = merge_module.split_geometry_ref(positions, query_len, window, num_splits, block, block, **geometry)
    assert (used > 1).any() and (used == 1).any(), used  # both kinds of run
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def _skinny_case(rows: int, n: int, k: int, bias: bool, config: tuple[int, int, int, int]) -> None:
    """fp16 (the interpreter has no bf16 dot): masked rows, features and K tails, the bias epilogue, x rows
    with a stride (a slice of a wider tensor)."""
    g = torch.Generator().manual_seed(rows * 7 + n + k)
    x = torch.randn(rows, k + 5, generator=g).half()[:, 3:k + 3]
    w = (torch.randn(n, k, generator=g) * 0.1).half()
    b = torch.randn(n, generator=g).half() if bias else None
    out = skinny_module.skinny_linear(x, w, b, config=config)
    ref = skinny_module.skinny_linear_ref(x.float(), w.float(), b.float() if bias else None)
    assert out.dtype == torch.float16 and out.shape == (rows, n)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)


def _epilogue_skinny_case(rows: int, n: int, k: int, gated: bool, residual: bool,
                          config: tuple[int, int, int, int]) -> None:
    """The SwiGLU epilogue (gate and up rows interleaved per program, a feature tail) and the residual add,
    fp16, with a bias."""
    g = torch.Generator().manual_seed(rows * 5 + n + k)
    x = torch.randn(rows, k, generator=g).half()
    w = (torch.randn(n, k, generator=g) * 0.1).half()
    b = torch.randn(n, generator=g).half()
    out_features = n // 2 if gated else n
    res = torch.randn(rows, out_features, generator=g).half() if residual else None
    out = skinny_module.skinny_linear(x, w, b, config=config, gated=gated, residual=res)
    ref = skinny_module.skinny_linear_ref(x.float(), w.float(), b.float(), gated=gated,
                                          residual=None if res is None else res.float())
    assert out.dtype == torch.float16 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)
    if residual:  # the epilogue rounds where eager torch does: exactly ``res + y``
        plain = skinny_module.skinny_linear(x, w, b, config=config, gated=gated)
        assert torch.equal(out, res + plain)


def _rotary_skinny_case(rows: int, num_heads: int, num_kv_heads: int, head_dim: int, width: int, bias: bool,
                        config: tuple[int, int, int, int]) -> None:
    """RoPE as the epilogue of a fused q|k|v projection (fp16): the first ``width`` features of each q and k head
    rotated (all of them, or a partial rotary embedding's), the rest and v untouched, each product and sum rounded
    as eager torch rounds them, so the result is exactly the stock rotation of the kernel's own plain projection;
    cos/sin rows strided, as the step's gathered table is."""
    g = torch.Generator().manual_seed(rows * 3 + num_heads + head_dim + width)
    k = 80
    n, rotary_cols = (num_heads + 2 * num_kv_heads) * head_dim, (num_heads + num_kv_heads) * head_dim
    x = torch.randn(rows, k, generator=g).half()
    w = (torch.randn(n, k, generator=g) * 0.1).half()
    b = torch.randn(n, generator=g).half() if bias else None
    cos, sin = torch.randn(2, rows, 1, width + 2, generator=g).half()[..., 1:width + 1].unbind(0)
    cos, sin = cos[:, 0], sin[:, 0]
    rope = dict(rope_cos=cos, rope_sin=sin, rotary_cols=rotary_cols, head_dim=head_dim)
    assert skinny_module.supports(x, w, b, config=config, **rope)  # the epilogue runs, not the reference
    out = skinny_module.skinny_linear(x, w, b, config=config, **rope)
    plain = skinny_module.skinny_linear(x, w, b, config=config)
    heads = plain[:, :rotary_cols].view(rows, -1, head_dim)
    rotated = torch.cat([apply_rotary(heads[..., :width], cos[:, None], sin[:, None]), heads[..., width:]], -1)
    expected = torch.cat([rotated.flatten(1), plain[:, rotary_cols:]], 1)
    assert out.dtype == torch.float16 and out.shape == (rows, n)
    assert torch.equal(out, expected)
    ref = skinny_module.skinny_linear_ref(x.float(), w.float(), None if b is None else b.float(),
                                          rope_cos=cos.float(), rope_sin=sin.float(), rotary_cols=rotary_cols,
                                          head_dim=head_dim)
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=1e-2)


def _move_rows_case(width: int, num_requests: int, row_shape: tuple[int, int], dtype: torch.dtype) -> None:
    """Accepted tree paths moved in three caches at once: each request's path (node indices rising, none below
    its depth, so one row's destination is often another's source) to base + j for its accepted j, the rest
    written onto themselves; rows wider than a program's columns (1 x 1100: two column tiles)."""
    g = torch.Generator().manual_seed(width * 11 + num_requests)
    caches = [torch.randn(12, 4, *row_shape, generator=g).to(dtype) for _ in range(3)]
    src, dst = [], []
    for r in range(num_requests):
        base = r * 12
        path = [0] + sorted((torch.randperm(10, generator=g)[:width - 1] + 1).tolist())  # rising, path[j] >= j
        accepted = int(torch.randint(1, width + 1, (1,), generator=g))
        src += [base + n for n in path]
        dst += [base + j if j < accepted else base + n for j, n in enumerate(path)]
    src, dst = torch.tensor(src), torch.tensor(dst)
    expected = [c.clone() for c in caches]
    move_rows_module.move_rows_ref(expected, None, src, dst, width)
    move_rows_module.move_rows(caches, move_rows_module.cache_table(caches), src, dst, width)
    for out, ref in zip(caches, expected):
        assert torch.equal(out, ref)


def _rms_norm_case(rows: int, width: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, width + 3, generator=g).to(dtype)[:, 3:]  # strided rows
    weight = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype)
    out = rms_norm_module.rms_norm(x, weight, 1e-6)
    ref = rms_norm_module.rms_norm_ref(x.float(), weight.float(), 1e-6)
    assert out.dtype == dtype and out.shape == (rows, width)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def _uniform_case(streams: tuple[int, int], shape: tuple[int, ...], salt: int) -> None:
    """Bit for bit the reference's draws: one stream or one per row (seed or offset per row), 63-bit seeds
    (their high half folded in), a draw longer than one program's block."""
    g = torch.Generator().manual_seed(sum(shape) + salt)
    seed = torch.randint(0, 2**62, (streams[0],), generator=g) * 2 + 1
    offset = torch.randint(0, 2**40, (streams[1],), generator=g)
    out = uniform_module.uniform(seed, offset, shape, salt)
    ref = uniform_module.uniform_ref(seed, offset, shape, salt)
    assert out.shape == ref.shape == shape and out.dtype == torch.float32
    assert torch.equal(out, ref) and 0 < out.min() and out.max() < 1


def _silu_mul_case(rows: int, width: int, dtype: torch.dtype) -> None:
    """Rows with a stride (a slice of a wider tensor), a column tail; fp16 rounds where the stock ops do."""
    g = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, 2 * width + 6, generator=g) * 3).to(dtype)[:, 6:]
    out = silu_mul_module.silu_mul(x)
    assert out.dtype == dtype and out.shape == (rows, width)
    torch.testing.assert_close(out.float(), silu_mul_module.silu_mul_ref(x.float()), atol=2e-3, rtol=2e-3)
    if dtype == torch.float16:  # silu rounded to fp16 before the product, as F.silu(gate) * up rounds
        torch.testing.assert_close(out, silu_mul_module.silu_mul_ref(x), atol=0, rtol=1e-3)


def _rotary_case(tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """q|k heads as a strided slice of a qkv row (the tail: v), a head count that is no multiple of the heads
    per program, cos/sin rows gathered from a wider table: the stock rotation exactly (bf16 through the kernel,
    fp32 through the reference), large angles included."""
    g = torch.Generator().manual_seed(tokens * 7 + num_heads + head_dim)
    qkv = torch.randn(tokens, num_heads + 2, head_dim, generator=g).to(dtype)
    x = qkv[:, :num_heads]
    cos, sin = torch.randn(2, tokens, 1, head_dim + 4, generator=g).to(dtype)[..., 2:head_dim + 2].unbind(0)
    out = rotary_module.rotary(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    assert torch.equal(out, rotary_module.rotary_ref(x, cos, sin))


def _qk_norm_rotary_case(tokens: int, num_heads: int, num_kv_heads: int, dim: int, width: int) -> None:
    """Qwen3's q/k norms then RoPE on a qkv row (rows strided, cos/sin rows gathered from a wider table, a head
    count that is no multiple of the heads per program; GLM-4.5's partial rotation): the reference's values, where
    the kernel's fp32 mean square may round one element a bf16 ulp apart."""
    g = torch.Generator().manual_seed(tokens * 5 + num_heads + dim + width)
    qkv = (torch.randn(tokens, (num_heads + 2 * num_kv_heads) * dim + 8, generator=g) * 3).bfloat16()[:, 8:]
    q_weight, k_weight = (1 + 0.2 * torch.randn(2, dim, generator=g)).bfloat16().unbind(0)
    cos, sin = torch.randn(2, tokens, width + 4, generator=g).bfloat16()[..., 2:width + 2].unbind(0)
    args = (qkv, q_weight, k_weight, 1e-6, cos, sin, num_heads, num_kv_heads)
    assert qk_norm_module.supports(*args[:3], cos, sin)
    out, ref = qk_norm_module.qk_norm_rotary(*args), qk_norm_module.qk_norm_rotary_ref(*args)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, num_heads + num_kv_heads, dim)
    assert (out != ref).float().mean() < 0.01
    torch.testing.assert_close(out.float(), ref.float(), atol=0.07, rtol=2 ** -7)


def _moe_align_case(num_tokens: int, top_k: int, num_experts: int, block_m: int, dtype: torch.dtype) -> None:
    """The one-program sort against the reference, to the bit (both are stable): half the pairs on expert 1 (a
    group of several blocks), the upper half of the experts idle, one id of no expert here (left out)."""
    g = torch.Generator().manual_seed(num_tokens * 7 + top_k + num_experts + block_m)
    ids = torch.randint(0, max(1, num_experts // 2), (num_tokens, top_k), generator=g)
    ids = torch.where(torch.rand(num_tokens, top_k, generator=g) < 0.5, 1, ids)
    ids[num_tokens // 2, 0] = num_experts
    ids = ids.to(dtype)
    for out, ref in zip(align_module.moe_align(ids, num_experts, block_m),
                        align_module.moe_align_ref(ids, num_experts, block_m)):
        assert torch.equal(out, ref), (out, ref)


def _moe_topk_case(num_tokens: int, num_experts: int, top_k: int, sigmoid: bool, round_to: int,
                   dtype: torch.dtype) -> None:
    """The router's choice against the reference: the same experts in the same order (the reference's top-k is
    sorted; distinct random logits have no ties), weights to an ulp or two (the kernel's exp is not torch's).
    ``dtype``: the logits' (a softmax router's come in the model dtype, widened by the kernel; distinct multiples of
    1/16 there, as random 16-bit logits tie)."""
    g = torch.Generator().manual_seed(num_tokens * 5 + num_experts + top_k + sigmoid)
    logits = torch.randn(num_tokens, num_experts, generator=g) * 3
    if dtype != torch.float32:
        ranks = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(num_tokens)])
        logits = ((ranks - num_experts / 2) / 16).to(dtype)
    bias = torch.randn(num_experts, generator=g) * 0.1 if sigmoid else None
    args = (logits, bias, top_k, sigmoid, True, 2.5 if sigmoid else 1.0, round_to)
    (weights, ids), (ref_weights, ref_ids) = topk_module.moe_topk(*args), topk_module.moe_topk_ref(*args)
    if sigmoid:  # the reference's sigmoid choice is unsorted: compare as sets, ordered by id
        ids, order = ids.sort(dim=-1)
        weights = weights.gather(1, order)
        ref_ids, ref_order = ref_ids.sort(dim=-1)
        ref_weights = ref_weights.gather(1, ref_order)
    assert torch.equal(ids, ref_ids), (ids, ref_ids)
    tol = 8e-3 if round_to else 1e-6  # a bf16 rounding may land one ulp apart
    torch.testing.assert_close(weights, ref_weights, atol=tol, rtol=tol)


def _router_logits_case(rows: int, hidden: int, experts: int, dtype: torch.dtype) -> None:
    """An fp32 router's logits against the reference (x in ``dtype``, the weight fp32): equal up to the order of the
    fp32 sums."""
    g = torch.Generator().manual_seed(rows * 3 + hidden + experts)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = torch.randn(experts, hidden, generator=g) * 0.05
    out, ref = router_module.router_logits(x, weight), router_module.router_logits_ref(x, weight)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _fused_moe_case(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype,
                    tiles: moe_module.MoeTiles | None) -> None:
    """Both GEMMs over the aligned blocks against the reference: H = 40, I = 24 (K and column tails), k distinct
    experts a token; ``tiles``: 64-row blocks of 16-wide tiles (several K steps, two column blocks, mostly padding)
    instead of the launch's own choice. bf16 rounds where the reference rounds, so only the sums' order may differ:
    an ulp at most (equal to the bit in these cases)."""
    g = torch.Generator().manual_seed(num_tokens * 5 + top_k + num_experts)
    hidden, inter = 40, 24
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    weights = torch.rand(num_tokens, top_k, generator=g)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]).int()
    out = moe_module.fused_moe(x, gate_up, down, weights, ids, tiles=tiles)
    ref = moe_module.fused_moe_ref(x, gate_up, down, weights, ids)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-6, "rtol": 2 ** -8}
    torch.testing.assert_close(out, ref, **tol)


def _engine_cases() -> None:
    """Greedy decoding with every attention call on the interpreted kernels equals HF generate: the flat
    layout keeps the promise the kernels rely on (runs of K+1 tokens of one request; MTP windows write
    through their own slots)."""
    import tempfile
    from pathlib import Path

    from tllm_spec import MTPConfig, SamplingParams, SpecModel
    from tllm_spec.drafts.mtp.model import save_random_mtp_weights
    from tllm_spec.tools.random_models import save_random_target, target_config

    from ..models import eagle3, hf_greedy, tiny_pair

    prompts, max_new = [[5, 17, 3, 44, 9, 2, 71], [12, 8]], [9, 6]
    params = [SamplingParams(max_new_tokens=n) for n in max_new]
    target, head = tiny_pair("mistral", num_layers=6)
    mtp_dir = Path(tempfile.mkdtemp(prefix="tllm_spec_interp_mtp_"))
    save_random_target(mtp_dir, target_config("llama"), seed=0)
    save_random_mtp_weights(mtp_dir, 2, "deepseek", seed=1)
    for name, path, spec in (("eagle3 K=3 (mistral, window)", target, eagle3(head, 3)),
                             ("vanilla MTP N=2", mtp_dir, MTPConfig(num_nextn_predict_layers=2, use_mtp_vanilla=True))):
        model = SpecModel.from_pretrained(path, spec, max_batch_size=2)
        for prompt, n, out in zip(prompts, max_new, model.generate(prompts, params)):
            assert out.token_ids == hf_greedy(path, prompt, n), (name, prompt)
        print(f"ok engine {name}")


def _fp8_cache_case(query_len: int, num_splits: int) -> None:
    """The kernel over an FP8 cache with per-tensor scales: keys and values read in q's dtype, k_scale in the
    softmax scale, v_scale on the output (no write through the kernels: this interpreter rounds fp32 -> FP8 wrongly
    across powers of two, tests/kernels/test_fp8_linear.py)."""
    g = torch.Generator().manual_seed(query_len + num_splits)
    page, d, runs, max_pages = 4, 16, 2, 6
    k_cache, v_cache = ((torch.randn(runs * max_pages + 1, page, 2, d, generator=g) * 4).to(torch.float8_e4m3fn)
                        for _ in range(2))
    block_tables = (torch.randperm(runs * max_pages, generator=g) + 1).int().view(runs, max_pages)
    positions = (torch.tensor([9, 17])[:, None] + torch.arange(query_len)).flatten()
    slots = torch.arange(runs).repeat_interleave(query_len)
    q = torch.randn(runs * query_len, 4, d, generator=g)
    args = (q, k_cache, v_cache, block_tables, slots, positions, d ** -0.5, max_pages * page)
    scales = {"query_len": query_len, "k_scale": 0.5, "v_scale": 3.0}
    out = attention_module.paged_attention(*args, num_splits=num_splits, **scales)
    torch.testing.assert_close(out, attention_module.paged_attention_ref(*args, **scales), atol=1e-5, rtol=1e-5)


def _lamport_cases(world: int, dtype: torch.dtype) -> None:
    """The Lamport all-reduce with each rank's kernel in a thread of its own over CPU buffers, so a rank polls while
    another pushes: shapes that change from call to call, a -0.0 among the values, more rows than programs; every
    rank holds the sum in rank order plus the residual and its norm, and every buffer is empty again after each
    call. The interpreter keeps one grid position and patches triton.language per launch, both process-wide: each
    rank runs one program, and the language stays patched while the threads run."""
    import triton.runtime.interpreter as interpreter

    lamport.SLOT_BYTES, programs, lamport.MAX_PROGRAMS = 4096, lamport.MAX_PROGRAMS, 1
    buffers = [torch.empty(lamport.buffer_elements(dtype, world), dtype=dtype) for _ in range(world)]
    ranks = [lamport.LamportBuffers.local(b, [a.data_ptr() for a in buffers], r) for r, b in enumerate(buffers)]
    g = torch.Generator().manual_seed(world)
    import triton.language.standard as standard

    held = [interpreter._patch_lang(f.fn) for f in (lamport._lamport_kernel, standard.zeros)]  # tl and tl.core
    patch, interpreter._patch_lang = interpreter._patch_lang, lambda fn: interpreter._LangPatchScope()
    for rows, width, residual, norm in [(1, 64, True, True), (3, 32, True, False), (5, 16, False, False),
                                        (2, 64, True, True)]:
        xs = [torch.randn(rows, width, generator=g).to(dtype) for _ in range(world)]
        xs[0][0, 0] = -0.0
        res = torch.randn(rows, width, generator=g).to(dtype) if residual else None
        weight = torch.rand(width, generator=g).to(dtype) if norm else None
        outs = [None] * world

        def rank_main(r: int) -> None:
            outs[r] = lamport.all_reduce_add_norm(xs[r], res, weight, 1e-5, ranks[r])

        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert all(out is not None for out in outs), "a rank never saw its peers' rows"
        total = sum(x.float() for x in xs).to(dtype)
        hidden = res + total if residual else total
        for out, normed in outs:
            assert torch.equal(out, hidden)
            if norm:
                torch.testing.assert_close(normed, rms_norm_module.rms_norm_ref(hidden, weight, 1e-5))
        assert all(bool((r.buffer.view(torch.int16) == lamport.NEGATIVE_ZERO).all()) for r in ranks)
    interpreter._patch_lang, lamport.MAX_PROGRAMS = patch, programs
    for scope in reversed(held):
        scope.restore()


def main() -> None:
    """Every case; with a path argument, the distinct launches saved there too (tests/kernels/launches.py)."""
    launches: set[Launch] = set()
    with recording(launches):
        _all_cases()
    if len(sys.argv) > 1:
        save(launches, Path(sys.argv[1]))
        print(f"recorded {len(launches)} distinct launches")


def _all_cases() -> None:
    grid = itertools.product([1, 2, 4, 6], [1, 3], [(4, 2), (6, 2), (3, 3)], [None, 5], [False, True])
    for query_len, num_runs, (hq, hkv), window, fused in grid:
        _paged_case(query_len, num_runs, hq, hkv, window, fused)
        print(f"ok paged_attention query_len={query_len} runs={num_runs} hq={hq} hkv={hkv} window={window} "
              f"fused_write={fused}")
    _split_cases()
    for query_len, num_splits in itertools.product([1, 4], [1, 3]):
        _fp8_cache_case(query_len, num_splits)
        print(f"ok fp8 cache paged_attention query_len={query_len} splits={num_splits}")
    skinny = itertools.product([1, 4, 16, 26], [(48, 100), (33, 256), (64, 300)], [False, True],
                               [(16, 64, 4, 2), (32, 128, 4, 3)])
    for rows, (n, k), bias, config in skinny:
        _skinny_case(rows, n, k, bias, config)
        print(f"ok skinny_linear rows={rows} n={n} k={k} bias={bias} tile={config}")
    epilogues = itertools.product([1, 5, 16, 32], [(96, 100), (50, 64)], [False, True], [False, True])
    for rows, (n, k), gated, residual in epilogues:
        _epilogue_skinny_case(rows, n, k, gated, residual, (16, 64, 4, 2))
        print(f"ok epilogue skinny_linear rows={rows} n={n} k={k} gated={gated} residual={residual}")
    rotary = itertools.product([1, 4, 16, 26], [(4, 2, 16, 16), (3, 1, 32, 32), (3, 1, 32, 16), (2, 2, 64, 32)],
                               [False, True])
    for rows, (num_heads, num_kv_heads, head_dim, width), bias in rotary:
        _rotary_skinny_case(rows, num_heads, num_kv_heads, head_dim, width, bias, (16, 64, 4, 2))
        print(f"ok rotary skinny_linear rows={rows} heads={num_heads}/{num_kv_heads} d={head_dim} rotated={width} "
              f"bias={bias}")
    for width, requests, row_shape, dtype in itertools.product([3, 8], [1, 3], [(2, 16), (1, 1100)],
                                                               [torch.float16, torch.float32]):
        _move_rows_case(width, requests, row_shape, dtype)
        print(f"ok move_rows width={width} requests={requests} row={row_shape} {dtype}")
    for rows, width, dtype in itertools.product([1, 4], [100, 4096], [torch.float16, torch.bfloat16]):
        _rms_norm_case(rows, width, dtype)
        print(f"ok rms_norm rows={rows} width={width} {dtype}")
    for streams, shape, salt in itertools.product([(1, 1), (3, 1), (1, 3), (3, 3)], [(3, 1500), (3, 2, 5)],
                                                  [0, 0x9E3779B9]):
        _uniform_case(streams, shape, salt)
        print(f"ok uniform streams={streams} shape={shape} salt={salt}")
    for rows, width, dtype in itertools.product([1, 5], [8, 1100], [torch.float16, torch.float32]):
        _silu_mul_case(rows, width, dtype)
        print(f"ok silu_mul rows={rows} width={width} {dtype}")
    for tokens, num_heads, head_dim, dtype in itertools.product([1, 6], [3, 10], [16, 12], [torch.bfloat16,
                                                                                           torch.float32]):
        _rotary_case(tokens, num_heads, head_dim, dtype)
        print(f"ok rotary tokens={tokens} heads={num_heads} d={head_dim} {dtype}")
    for tokens, (num_heads, num_kv_heads), (dim, width) in itertools.product([1, 5], [(4, 2), (7, 1)],
                                                                             [(32, 32), (64, 32), (16, 8)]):
        _qk_norm_rotary_case(tokens, num_heads, num_kv_heads, dim, width)
        print(f"ok qk_norm_rotary tokens={tokens} heads={num_heads}/{num_kv_heads} d={dim} rotated={width}")
    moe_shapes = [(1, 1, 8), (1, 8, 64), (3, 2, 8), (100, 2, 8), (25, 8, 64), (200, 1, 64)]
    for (num_tokens, top_k, num_experts), block_m, dtype in itertools.product(
            moe_shapes + [(512, 8, 512)], [16, 64], [torch.int32, torch.int64]):
        _moe_align_case(num_tokens, top_k, num_experts, block_m, dtype)
        print(f"ok moe_align tokens={num_tokens} k={top_k} experts={num_experts} block_m={block_m} {dtype}")
    tile_cases = {"chosen": None, "small": moe_module.MoeTiles(64, (16, 16, 4, 1), (16, 16, 4, 1)),
                  "direct": moe_module.MoeTiles(16, (16, 16, 4, 1), (16, 16, 4, 1), direct=True)}
    for (num_tokens, top_k, num_experts), dtype, (name, tiles) in itertools.product(
            moe_shapes, [torch.float32, torch.bfloat16], tile_cases.items()):
        _fused_moe_case(num_tokens, top_k, num_experts, dtype, tiles)
        print(f"ok fused_moe tokens={num_tokens} k={top_k} experts={num_experts} {dtype} tiles={name}")
    for (num_tokens, num_experts, top_k), sigmoid, round_to, dtype in itertools.product(
            [(1, 8, 2), (5, 128, 8), (3, 60, 4)], [False, True], [0, 1], [torch.float32, torch.bfloat16]):
        _moe_topk_case(num_tokens, num_experts, top_k, sigmoid, round_to, dtype)
        print(f"ok moe_topk tokens={num_tokens} experts={num_experts} k={top_k} sigmoid={sigmoid} round={round_to} "
              f"{dtype}")
    for rows, hidden, experts, dtype in itertools.product([1, 4, 32], [100, 4096], [8, 60],
                                                          [torch.bfloat16, torch.float32]):
        _router_logits_case(rows, hidden, experts, dtype)
        print(f"ok router_logits rows={rows} hidden={hidden} experts={experts} {dtype}")
    for world in (2, 3):  # fp16: this interpreter's bf16 bit casts differ from the GPU's (tests/gpu covers bf16)
        _lamport_cases(world, torch.float16)
        print(f"ok lamport all-reduce world={world} fp16")
    _engine_cases()


if __name__ == "__main__":
    main()
