"""Prefix caching under tensor parallelism on the CPU (gloo, world size 2): each rank keeps its own pool and cache,
and the ranks must agree on every hit (a rank that reused a page its peer prefills would run a different chunk
and hang in a collective). A shared-prefix batch twice, cold then warm: the tokens of the single-process engine
with the cache off, every rank's acceptance that of the cache off at TP 2, prompt tokens reused on the warm run,
and every rank's pool whole afterwards."""
from __future__ import annotations

from pathlib import Path

import pytest

from tllm_spec import SamplingParams
from tllm_spec.spec_model import SpecModel

from ..models import eagle3
from .test_tensor_parallel import WORLD_SIZE, run_ranks, tiny_tp_pair

PAGE = 8
SHARED = [(5 * i + 2) % 97 for i in range(40)]  # 5 pages
PROMPTS = [SHARED + [1, 2, 3], SHARED + [9, 8], SHARED + list(range(20, 31))]
PARAMS = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 9, 14)]


def _cold_then_warm(target: str, head: str) -> dict:
    """On one rank: the batch with the cache off, then twice with it on; each run's (tokens, acceptance, cached
    prompt tokens) per request, and the cached model's pool once idle."""
    def run(model: SpecModel) -> list[tuple[list[int], list[int], int]]:
        return [(o.token_ids, o.stats.accepted_per_step, o.stats.cached_prompt_tokens)
                for o in model.generate(PROMPTS, PARAMS)]
    engine = {"max_batch_size": 3, "page_size": PAGE, "tensor_parallel_size": WORLD_SIZE}
    off = run(SpecModel.from_pretrained(target, eagle3(Path(head), 3), enable_prefix_caching=False, **engine))
    model = SpecModel.from_pretrained(target, eagle3(Path(head), 3), enable_prefix_caching=True, **engine)
    cold, warm = run(model), run(model)
    pages = model.runner.kv_cache.pages
    pool = model.loop.call(lambda: (pages.num_in_use, pages.num_available, pages.total, pages.num_cached))
    return {"off": off, "cold": cold, "warm": warm, "pool": pool, "hits": model.engine.prefix_cache.hits}


@pytest.mark.slow  # two processes loading and decoding three models: tens of seconds on the 2-core machine
def test_tp2_prefix_cache_cold_then_warm_equals_the_cache_off_outputs_on_every_rank():
    target, head = tiny_tp_pair("llama")
    ranks = run_ranks(_cold_then_warm, str(target), str(head))
    for answer in ranks:
        assert not (isinstance(answer, tuple) and answer[0] == "error"), answer[1]
    assert ranks[0] == ranks[1]  # the same hits, tokens and acceptance on every rank
    answer = ranks[0]
    single = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=3, page_size=PAGE)
    expected = [o.token_ids for o in single.generate(PROMPTS, PARAMS)]
    assert [tokens for tokens, _, _ in answer["off"]] == expected
    for run in ("cold", "warm"):  # tokens and acceptance of the cache off (so the reused draft K/V is right too)
        assert [out[:2] for out in answer[run]] == [out[:2] for out in answer["off"]], run
    assert all(cached == 0 for *_, cached in answer["off"])
    # warm: each prompt reuses its pages but the one holding its last token (the EAGLE-3 head keys one ahead)
    assert [cached for *_, cached in answer["warm"]] == [(len(p) - 1) // PAGE * PAGE for p in PROMPTS]
    num_in_use, num_available, total, num_cached = answer["pool"]
    assert (num_in_use, num_available) == (0, total) and num_cached >= len(SHARED) // PAGE
    assert answer["hits"] >= sum(cached for *_, cached in answer["warm"])
