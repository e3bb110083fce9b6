"""Where compiled code is kept between processes: Inductor's and Triton's caches and FlashInfer's JIT builds.

``TLLM_SPEC_CACHE_DIR=DIR`` puts all three under one directory (``DIR/inductor``, ``DIR/triton``,
``DIR/flashinfer``), so a second process or a restarted server reuses what the first compiled; a cache whose own
variable is already set keeps it. Applied when ``tllm_spec`` is imported: before anything compiles and before
FlashInfer (imported lazily) reads its workspace. The compiled step's Dynamo traces live in Inductor's directory
(``inductor/dynamo``, :mod:`tllm_spec.trace_cache`). Where a cache lives never changes a result.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

CACHE_DIR_VAR = "TLLM_SPEC_CACHE_DIR"
CACHE_VARS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton",
              "FLASHINFER_WORKSPACE_BASE": "flashinfer"}


def configure_caches(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Point each cache variable not set yet at its directory under ``TLLM_SPEC_CACHE_DIR`` (nothing if that
    is unset or empty); returns the variables set here."""
    root = environ.get(CACHE_DIR_VAR, "").strip()
    if not root:
        return {}
    chosen = {var: str(Path(root).expanduser() / sub) for var, sub in CACHE_VARS.items() if var not in environ}
    environ.update(chosen)
    return chosen
