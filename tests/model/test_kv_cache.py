"""Paged KV cache: the allocator on its own, committed K/V after rejected drafts, and no page leaks."""
from __future__ import annotations

import pytest
import torch

from tllm_spec import SamplingParams
from tllm_spec.engine.request import Request
from tllm_spec.model.kv_cache import SCRATCH_PAGE, KVCache
from tllm_spec.sampling.forcing import ENV_VAR
from tllm_spec.spec_model import SpecModel

from ..models import eagle3, hf_greedy, hf_model, tiny_pair

PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6, 7, 8, 9], [33, 34, 35, 36]]
MAX_NEW = [14, 9, 17, 5]


def small_cache(num_pages: int = 6, page_size: int = 4, max_requests: int = 3, max_tokens: int = 12) -> KVCache:
    return KVCache([(2, 3), (1, 5)], num_pages, page_size, max_requests, max_tokens, torch.float32, "cpu")


# ---- KVCache on its own ---------------------------------------------------------------------------------------

def test_allocate_free_round_trip():
    kv = small_cache()
    slot = kv.allocate(9)  # ceil(9 / 4) = 3 pages
    assert (kv.num_free_pages, kv.num_free_slots) == (5 - 3, 2)
    pages = kv.block_tables[slot, :3].tolist()
    assert len(set(pages)) == 3
    kv.free(slot)
    assert (kv.num_free_pages, kv.num_free_slots) == (5, 3)
    again = kv.allocate(9)  # LIFO free lists: the same slot and pages come back
    assert again == slot and kv.block_tables[again, :3].tolist() == pages


def test_scratch_page_never_handed_out():
    kv = small_cache(num_pages=7, max_requests=3, max_tokens=8)  # 6 real pages, 2 per request
    slots = [kv.allocate(8) for _ in range(3)]
    handed_out = sorted(p for s in slots for p in kv.block_tables[s].tolist())
    assert handed_out == [1, 2, 3, 4, 5, 6]  # every page but the scratch page, each once
    assert kv.num_free_pages == 0 and not kv.can_allocate(1)


def test_unused_block_table_entries_point_at_scratch():
    kv = small_cache()
    slot = kv.allocate(3)  # 1 of 3 pages
    assert kv.block_tables[slot, 1:].tolist() == [SCRATCH_PAGE, SCRATCH_PAGE]
    assert kv.block_tables[slot, 0].item() != SCRATCH_PAGE


def test_write_index_on_hand_built_block_table():
    kv = small_cache(num_pages=8, page_size=4, max_requests=2, max_tokens=12)
    kv.block_tables[0] = torch.tensor([5, 2, 7], dtype=torch.int32)
    kv.block_tables[1] = torch.tensor([3, 1, 6], dtype=torch.int32)
    slots = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    positions = torch.tensor([0, 3, 4, 11, 0, 5, 10])
    # page * page_size + position % page_size
    expected = [5 * 4 + 0, 5 * 4 + 3, 2 * 4 + 0, 7 * 4 + 3, 3 * 4 + 0, 1 * 4 + 1, 6 * 4 + 2]
    index = kv.write_index(slots, positions)
    assert index.dtype == torch.int64 and index.tolist() == expected


def test_gather_request_follows_the_block_table():
    kv = small_cache(num_pages=6, page_size=4, max_requests=2, max_tokens=12)
    kv.allocate(4)  # takes page 1 so the next request's pages are not in order 1, 2, 3
    slot = kv.allocate(10)
    positions = torch.arange(10)
    index = kv.write_index(torch.full((10,), slot), positions)
    values = positions.float()[:, None, None].expand(10, 1, 5)
    kv.k[1].view(-1, 1, 5).index_copy_(0, index, values)
    kv.v[1].view(-1, 1, 5).index_copy_(0, index, -values)
    k, v = kv.gather_request(1, slot, 10)
    assert k.shape == (10, 1, 5)
    assert torch.equal(k, values) and torch.equal(v, -values)


def test_allocate_beyond_capacity_raises_and_changes_nothing():
    kv = small_cache(num_pages=6, page_size=4, max_requests=3, max_tokens=12)  # 5 real pages, 3 per request
    with pytest.raises(ValueError, match="block table"):
        kv.allocate(13)  # 4 pages > a request's 3-page block table
    kv.allocate(12)
    with pytest.raises(RuntimeError, match="exhausted"):
        kv.allocate(12)  # 3 pages wanted, 2 free
    assert (kv.num_free_pages, kv.num_free_slots) == (2, 2)
    kv.allocate(4)
    kv.allocate(4)
    with pytest.raises(RuntimeError, match="exhausted"):
        kv.allocate(1)  # no page left (slots remain)
    kv2 = small_cache(num_pages=6, max_requests=1)
    kv2.allocate(1)
    with pytest.raises(RuntimeError):
        kv2.allocate(1)  # pages remain, no slot left


def test_free_resets_block_table_row():
    kv = small_cache()
    slot = kv.allocate(12)
    assert (kv.block_tables[slot] != SCRATCH_PAGE).all()
    kv.free(slot)
    assert (kv.block_tables[slot] == SCRATCH_PAGE).all()


def test_block_table_rows_reach_the_device_together_when_next_read(monkeypatch):
    """allocate and free change rows on the host; the device table takes them in one copy when it is next read
    (or flushed): a slot freed and handed out again before that holds its new pages."""
    kv = small_cache(num_pages=10, max_requests=3)
    copies = []
    index_copy = torch.Tensor.index_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda t, *a: copies.append(a) or index_copy(t, *a))
    first, second = kv.allocate(9), kv.allocate(4)
    kv.free(first)
    third = kv.allocate(5)  # takes the freed slot back
    assert third == first and (kv._block_tables == SCRATCH_PAGE).all()  # nothing written yet
    table = kv.block_tables
    assert len(copies) == 1
    assert table[second].tolist() == kv._pages[second] + [SCRATCH_PAGE] * 2
    assert table[third].tolist() == kv._pages[third] + [SCRATCH_PAGE]
    kv.free(second)
    kv.flush()
    assert (kv.block_tables[second] == SCRATCH_PAGE).all() and len(copies) == 2
    kv.flush()  # nothing changed: no copy
    assert len(copies) == 2


def test_pool_needs_a_page_beyond_scratch():
    with pytest.raises(ValueError, match="at least 2 pages"):
        small_cache(num_pages=1)


# ---- committed K/V after generation ---------------------------------------------------------------------------

def capture_at_free(monkeypatch, model: SpecModel) -> dict[int, tuple[Request, list, dict[int, int]]]:
    """request index -> (request, [(K, V) of every target layer over the slot's pages], {position: token fed
    to the target there}), all taken just before the engine frees the request's slot."""
    kv, num_layers = model.runner.kv_cache, model.target.num_layers
    fed: dict[int, dict[int, int]] = {}
    pending: dict[int, tuple[list, dict[int, int]]] = {}
    captured: dict[int, tuple[Request, list, dict[int, int]]] = {}
    real_forward, real_free, real_to_output = model.runner.model.forward, kv.free, Request.to_output

    def forward(input_ids, attn, draft_tokens):
        for token, slot, pos in zip(input_ids.tolist(), attn.token_slots.tolist(), attn.positions.tolist()):
            fed.setdefault(slot, {})[pos] = token  # later steps overwrite rejected positions
        return real_forward(input_ids, attn, draft_tokens)

    def free(slot):
        snapshot = [kv.gather_request(layer, slot, 1 << 30) for layer in range(num_layers)]
        pending[slot] = (snapshot, fed.pop(slot))
        real_free(slot)

    def to_output(self):  # the engine calls this right after freeing the request's slot
        captured[self.index] = (self, *pending.pop(self.slot))
        return real_to_output(self)

    monkeypatch.setattr(model.runner.model, "forward", forward)
    monkeypatch.setattr(kv, "free", free)
    monkeypatch.setattr(Request, "to_output", to_output)
    return captured


def assert_kv_equals_prefill(target, snapshot: list, tokens: list[int]) -> None:
    """Cached target K/V of positions 0..len(tokens)-1 == HF's own prefill of ``tokens`` (post-RoPE)."""
    with torch.no_grad():
        pkv = hf_model(target)(torch.tensor([tokens]), use_cache=True).past_key_values
    assert len(pkv.layers) == len(snapshot)
    for layer, (k, v) in enumerate(snapshot):
        ref_k, ref_v = pkv.layers[layer].keys[0].transpose(0, 1), pkv.layers[layer].values[0].transpose(0, 1)
        torch.testing.assert_close(k[:len(tokens)], ref_k, atol=1e-4, rtol=1e-4, msg=f"keys of layer {layer}")
        torch.testing.assert_close(v[:len(tokens)], ref_v, atol=1e-4, rtol=1e-4, msg=f"values of layer {layer}")


@pytest.mark.parametrize("arch,batch", [("llama", 1), ("llama", 3), ("qwen2", 3), ("qwen3", 3)])
def test_kv_after_rejections_holds_committed_tokens(monkeypatch, arch, batch):
    target, head = tiny_pair(arch)
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=batch)
    captured = capture_at_free(monkeypatch, model)
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])  # 4 prompts: slots reused
    assert sorted(captured) == list(range(len(PROMPTS)))
    for out in outs:
        request, snapshot, fed = captured[out.index]
        assert out.token_ids == hf_greedy(target, out.prompt_token_ids, len(out.token_ids))
        assert out.stats.histogram[0] > 0  # rejected drafts: stale K/V was written past the committed length
        committed = out.prompt_token_ids + out.token_ids[:-1]  # the last token never has target K/V
        assert request.num_cached >= len(committed)
        assert [fed[p] for p in range(len(committed))] == committed
        assert_kv_equals_prefill(target, snapshot, committed)


def test_kv_under_forced_acceptance_holds_the_fed_drafts(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "2")  # read when the worker is built
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=3)
    captured = capture_at_free(monkeypatch, model)
    max_new = [7, 10, 13]  # 1 (context step) + 3 per generation step: no trimming at the end
    outs = model.generate(PROMPTS[:3], [SamplingParams(max_new_tokens=n) for n in max_new])
    for out, n in zip(outs, max_new):
        request, snapshot, fed = captured[out.index]
        steps = (n - 1) // 3
        assert len(out.token_ids) == n
        assert out.stats.histogram == [0, 0, steps, 0]  # every generation step accepted 2 drafts + bonus
        assert request.num_cached == len(out.prompt_token_ids) + n - 1
        # forced acceptance commits the drafts that were fed, which need not equal the target's tokens
        fed_tokens = [fed[p] for p in range(request.num_cached)]
        assert fed_tokens[:len(out.prompt_token_ids)] == out.prompt_token_ids
        assert_kv_equals_prefill(target, snapshot, fed_tokens)


# ---- no leaks under pool pressure -----------------------------------------------------------------------------

@pytest.mark.slow  # five to eight seconds on the 2-core machine, out of the README command for its margin
def test_no_page_leak_under_pool_pressure(monkeypatch):
    target, head = tiny_pair("llama")
    # reservation = prompt + max_new + 2K + 1 = 17..32 tokens = 3..4 pages of 8; 8 real pages hold at most 2
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=3, page_size=8, num_pages=9)
    kv = model.runner.kv_cache
    free_pages, free_slots = kv.num_free_pages, kv.num_free_slots
    assert (free_pages, free_slots) == (8, 3)
    # no token 0: hf_greedy passes pad_token_id=0, so HF would mask a 0 in the prompt as padding
    prompts = [[1 + (7 * i + j) % 96 for j in range(3 + i % 8)] for i in range(20)]
    max_new = [7 + (5 * i) % 9 for i in range(20)]
    params = [SamplingParams(max_new_tokens=n) for n in max_new]
    expected = [hf_greedy(target, p, n) for p, n in zip(prompts, max_new)]
    in_flight: list[int] = []
    real_allocate = kv.allocate

    def allocate(num_tokens, shared=()):
        in_flight.append(kv.num_free_slots)
        return real_allocate(num_tokens, shared)

    monkeypatch.setattr(kv, "allocate", allocate)
    for _ in range(2):  # a second call shows no drift
        in_flight.clear()
        outs = model.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected
        assert all(o.finish_reason == "length" for o in outs)
        assert (kv.num_free_pages, kv.num_free_slots) == (free_pages, free_slots)
        assert (kv.block_tables == SCRATCH_PAGE).all()
        # free slots seen at each admission: never below 2 (the pool, not the batch, is the limit), and
        # requests did run two at a time
        assert len(in_flight) == 20 and min(in_flight) == 2
