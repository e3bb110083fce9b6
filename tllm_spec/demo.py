"""The embedded default model pair, addressed as ``demo://target``, ``demo://eagle3`` and ``demo://mtp``.

The trained pair ships inside the package (``tllm_spec/assets/demo``, built by ``scripts/build_demo_models.py``:
a small Llama target trained on the Python standard library, its EAGLE-3 head and one MTP module with
DeepSeek-style keys). Addresses are resolved once, where the user's input enters (``SpecModel.from_pretrained``
and the spec configs it is given), so loaders only ever see real paths.
"""
from __future__ import annotations

import os
from pathlib import Path

PREFIX = "demo://"
ASSETS = Path(__file__).parent / "assets" / "demo"


def is_trained() -> bool:
    return (ASSETS / "target" / "config.json").is_file()


def resolve(path: str | os.PathLike) -> Path:
    """Map ``demo://NAME`` to the shipped directory; other paths unchanged."""
    text = str(path)
    if not text.startswith(PREFIX):
        return Path(path)
    name = text[len(PREFIX):]
    if not (ASSETS / name).is_dir():
        have = sorted(p.name for p in ASSETS.iterdir() if p.is_dir()) if ASSETS.is_dir() else []
        raise FileNotFoundError(f"{text}: the embedded demo has no {name!r}; it has {have} (in {ASSETS})")
    return ASSETS / name
