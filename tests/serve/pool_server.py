"""The real server with a view of its KV pool, for the soak:

    python -m tests.serve.pool_server '{"enable_prefix_caching": true, "num_pages": 400}' serve [serve's flags]

runs ``tllm-spec serve`` with those EngineConfig fields set (ones no flag sets, such as the pool's size) and one
more route, GET /test/kv_pool: the pool recounted page by page on the engine's thread between steps (``whole``:
every page but the scratch page free, evictable or held, exactly once, no hold count below zero), the prefix
cache's counters, and how many cached pages allocations have evicted so far."""
from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from tllm_spec.config import EngineConfig
from tllm_spec.model.page_pool import PagePool
from tllm_spec.serve import app as app_module
from tllm_spec.serve import cli
from tllm_spec.spec_model import SpecModel

ROUTE = "/test/kv_pool"


def count_evictions(pool: PagePool) -> list[int]:
    """A one-item counter of the pool's evictions from now on."""
    count, evict = [0], pool._evict

    def counting() -> int:
        count[0] += 1
        return evict()
    pool._evict = counting
    return count


def pool_state(model: SpecModel, evictions: list[int]) -> dict:
    """Run on the engine's thread, between steps."""
    engine = model.engine
    pool, cache = engine.kv.pages, engine.prefix_cache
    held = [page for page, refs in enumerate(pool._refs) if refs > 0]
    listed = sorted([*pool._free, *pool._evictable, *held])
    return {"total": pool.total, "available": pool.num_available, "evictable": pool.num_evictable,
            "in_use": pool.num_in_use, "cached": pool.num_cached, "free_slots": engine.kv.num_free_slots,
            "whole": listed == list(range(1, pool.total + 1)) and min(pool._refs) >= 0,
            "queries": cache.queries, "hits": cache.hits, "evictions": evictions[0]}


def main(argv: Sequence[str]) -> int:
    fields = json.loads(argv[0])
    engine_config_of, build_app = cli.engine_config_of, app_module.build_app

    def with_fields(args) -> EngineConfig:
        return EngineConfig.model_validate({**engine_config_of(args).model_dump(), **fields})

    def build(model: SpecModel, *args, **kwargs):
        app = build_app(model, *args, **kwargs)
        evictions = count_evictions(model.engine.kv.pages)
        app.add_api_route(ROUTE, lambda: model.loop.call(lambda: pool_state(model, evictions)), methods=["GET"])
        return app
    cli.engine_config_of, app_module.build_app = with_fields, build
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
