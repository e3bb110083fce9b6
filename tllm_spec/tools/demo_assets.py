"""The demo pair as shipped files: the held-out prompt list, the CPU acceptance check, the size budget, and the
packing into parts small enough to carry back from the training machine."""
from __future__ import annotations

import io
import json
import os
import platform
import tarfile
from pathlib import Path

import torch

from ..config import Eagle3Config, MTPConfig

MAX_BYTES = 25_000_000  # the whole shipped pair
MAX_FILE_BYTES = 15_000_000  # any single file, shipped or packed
PACK_NAME = "demo_assets.tgz"


def write_heldout(path: Path, corpus: list[Path], heldout: list[Path], rule: str, prompt_chars: int) -> None:
    """``heldout.json``: the held-out files (relative to the corpus root) and each one's opening text, so that
    evaluation prompts do not depend on the local Python's standard library."""
    root = corpus_root(corpus)
    entries = [{"file": str(f.relative_to(root)),
                "text": f.read_text(encoding="utf-8", errors="replace")[:prompt_chars]} for f in heldout]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rule": rule, "root": str(root), "python": platform.python_version(),
                                "num_files": len(corpus), "files": [e["file"] for e in entries], "prompts": entries},
                               indent=1))


def corpus_root(files: list[Path]) -> Path:
    """The deepest directory holding every corpus file."""
    root = Path(os.path.commonpath([str(f) for f in files]))
    return root.parent if root.is_file() else root


def cpu_check(demo_dir: Path, prompt_tokens: int = 64, new_tokens: int = 64, num_prompts: int = 16, k: int = 3,
              temperatures: tuple[float, ...] = (0.0, 1.0)) -> dict:
    """Acceptance of both heads on held-out prompts, decoded on the CPU as a user would: ``result[head]`` at
    T = 0, ``result[head + "_T1"]`` at T = 1 with rejection sampling (and likewise for other temperatures)."""
    from ..tokenizer import load_tokenizer
    from .acceptance_eval import acceptance, heldout_texts, load, prompt_ids

    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 4))  # a user's laptop, not a 100-core host; tiny ops gain nothing
    prompts = prompt_ids(load_tokenizer(demo_dir / "target"), heldout_texts(demo_dir / "heldout.json"),
                         num_prompts, prompt_tokens)
    result = {"num_prompts": len(prompts), "prompt_tokens": prompt_tokens, "max_new_tokens": new_tokens, "k": k}
    specs = {"eagle3": Eagle3Config(speculative_model=str(demo_dir / "eagle3"), max_draft_len=k,
                                    use_rejection_sampling=True),
             "mtp": MTPConfig(max_draft_len=k, mtp_checkpoint=str(demo_dir / "mtp"), use_rejection_sampling=True)}
    for name, spec in specs.items():
        model = load(str(demo_dir / "target"), spec, "cpu", "float32", prompt_tokens + new_tokens + 16)
        for temperature in temperatures:
            key = name if temperature == 0 else f"{name}_T{temperature:g}"
            result[key] = acceptance(model, prompts, new_tokens, temperature=temperature)
            print(f"cpu check {key}: mean accepted length {result[key]['mean_accepted_length']:.3f} "
                  f"{result[key]['acceptance_rate_per_position']}", flush=True)
    torch.set_num_threads(threads)
    return result


def check_sizes(demo_dir: Path) -> dict[str, int]:
    """Bytes per shipped file; raises if the pair exceeds MAX_BYTES or a file MAX_FILE_BYTES."""
    sizes = {str(p.relative_to(demo_dir)): p.stat().st_size for p in sorted(demo_dir.rglob("*")) if p.is_file()}
    big = {name: size for name, size in sizes.items() if size > MAX_FILE_BYTES}
    if big or sum(sizes.values()) > MAX_BYTES:
        raise ValueError(f"demo pair too large: {sum(sizes.values())} bytes (limit {MAX_BYTES}), files over "
                         f"{MAX_FILE_BYTES}: {big}")
    sizes["total"] = sum(sizes.values())
    return sizes


def pack(demo_dir: Path, out: Path, part_bytes: int = 14_000_000) -> list[Path]:
    """``demo/`` as a gzipped tar split into ``PACK_NAME.000``, ``.001``, ... parts of at most ``part_bytes``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(demo_dir, arcname="demo")
    data = buffer.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(PACK_NAME + ".*"):
        stale.unlink()
    parts = []
    for i, start in enumerate(range(0, len(data), part_bytes)):
        parts.append(out / f"{PACK_NAME}.{i:03d}")
        parts[-1].write_bytes(data[start:start + part_bytes])
    return parts


def unpack_command(out: str | Path) -> str:
    """The shell command, run from the repository root, that puts the packed pair in ``tllm_spec/assets/demo``."""
    return (f"rm -rf tllm_spec/assets/demo && mkdir -p tllm_spec/assets && "
            f"cat {out}/{PACK_NAME}.* | tar xzf - -C tllm_spec/assets")
