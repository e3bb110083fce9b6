"""The one place flashinfer is imported: lazily, version-checked once, CUDA tensors only.

Missing, unloadable or older than :data:`MIN_VERSION`: one warning, then the torch path everywhere.
"""
from __future__ import annotations

import functools
import os
import re
import threading
import time
import types
import warnings

import torch

MIN_VERSION = (0, 7)
# vocabularies below this sample on the torch path on CUDA too: its sort over a few thousand logits is a handful of
# small kernels inside the graph, and a model that small (the embedded demo, 4096) should not wait for FlashInfer's
# sampling JIT build (a minute or more on a fresh machine) to start
MIN_VOCAB = 32768


@functools.cache
def load_flashinfer() -> types.ModuleType | None:
    """flashinfer if importable and new enough, else None after one warning (the torch path is used)."""
    try:
        import flashinfer
        import flashinfer.sampling  # noqa: F401
    except Exception as err:  # not installed, or its JIT runtime cannot load on this machine
        return _unusable(f"flashinfer cannot be imported ({type(err).__name__}: {err})")
    version = getattr(flashinfer, "__version__", "")
    if parse_version(version) < MIN_VERSION:
        return _unusable(f"flashinfer {version or '(no version)'} is older than "
                         f"{'.'.join(map(str, MIN_VERSION))}")
    return flashinfer


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``0.7.2.post1``; (0, 0) if there is none."""
    match = re.match(r"\s*(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def _unusable(reason: str) -> None:
    warnings.warn(f"{reason}; tllm_spec samples with its torch path on CUDA instead (slower)", stacklevel=3)
    return None


@torch.compiler.assume_constant_result  # a compiled step bakes the answer in instead of tracing the import
def available(device: torch.device) -> bool:
    return device.type == "cuda" and load_flashinfer() is not None


def worth_it(vocab_size: int) -> bool:
    """Whether a model of ``vocab_size`` samples with FlashInfer (where it is available): see MIN_VOCAB."""
    return vocab_size >= MIN_VOCAB


_build_lock = threading.Lock()
_build_thread: threading.Thread | None = None


def start_sampling_build(device: torch.device) -> None:
    """Build (or load from its cache) FlashInfer's sampling module on a background thread, so a start-up spends
    the JIT build's minutes beside torch.compile instead of after it; nothing where FlashInfer is not used (off
    CUDA, or missing), or once started. :func:`wait_sampling_build` joins it."""
    global _build_thread
    if not available(device):
        return
    with _build_lock:
        if _build_thread is None:
            # nvcc optimises the module's kernels on parallel threads unless the user set FlashInfer's extra flags
            # (its sampling build: 96 s -> 60 s on a 16-core H200 host)
            os.environ.setdefault("FLASHINFER_EXTRA_CUDAFLAGS", "--split-compile=0")
            fi = load_flashinfer()  # imported here, on the caller's thread; the thread only builds
            times: dict[str, float] = {}
            _build_thread = threading.Thread(target=_build_sampling_module, args=(fi, times), daemon=True,
                                             name="tllm_spec-flashinfer-build")
            _build_thread.times = times
            _build_thread.start()


def sampling_build_times() -> dict[str, float]:
    """When the background build "began" and "ended" (time.time()); empty if none was started (start-up report)."""
    with _build_lock:
        return dict(getattr(_build_thread, "times", {}))


def _build_sampling_module(fi: types.ModuleType, times: dict[str, float]) -> None:
    times["began"] = time.time()
    try:
        fi.sampling.get_sampling_module()
    except Exception as err:  # reported again, with its trace, by the first sampling call that needs it
        warnings.warn(f"FlashInfer's sampling module failed to build in the background: {err}", stacklevel=1)
    finally:
        times["ended"] = time.time()


def sampling_build_running() -> bool:
    """Whether a build started by :func:`start_sampling_build` is still going (a progress bar names the wait)."""
    with _build_lock:
        return _build_thread is not None and _build_thread.is_alive()


def wait_sampling_build() -> None:
    """Block until a build started by :func:`start_sampling_build` has finished (at once if none was)."""
    with _build_lock:
        thread = _build_thread
    if thread is not None:
        thread.join()


# FlashInfer's samplers as torch custom ops, so a compiled generation step traces them as single nodes (no graph
# break) and Inductor fuses the elementwise work around them. seed/offset are read on the device, not mutated.
@torch.library.custom_op("tllm_spec::flashinfer_top_k_top_p_sample", mutates_args=())
def top_k_top_p_sample(probs_logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                       seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Sample one token per row from temperature-scaled logits [R, V] (top_ks [R] int32, top_ps [R] f32) ->
    [R] int64. seed/offset are [1] int64 device tensors: read on the device, so the call is CUDA-graph safe."""
    wait_sampling_build()
    fi = load_flashinfer()
    return fi.sampling.top_k_top_p_sampling_from_logits(
        probs_logits, top_ks, top_ps, deterministic=True, check_nan=False, seed=seed, offset=offset
    ).to(torch.int64)


@top_k_top_p_sample.register_fake
def _(probs_logits, top_ks, top_ps, seed, offset):
    return probs_logits.new_empty(probs_logits.shape[0], dtype=torch.int64)


@torch.library.custom_op("tllm_spec::flashinfer_chain_speculative_sampling", mutates_args=())
def chain_speculative_sampling(draft_probs: torch.Tensor, draft_ids: torch.Tensor, target_probs: torch.Tensor,
                               seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """flashinfer's rejection sampler: the tokens [B, n+1] int64, accepted drafts then the correction/bonus,
    padded with -1."""
    wait_sampling_build()
    fi = load_flashinfer()
    num_rows = draft_ids.shape[0]
    accepted = torch.zeros(num_rows, dtype=torch.int32, device=draft_ids.device)
    emitted = torch.zeros(num_rows, dtype=torch.int32, device=draft_ids.device)
    tokens, _, _ = fi.sampling.chain_speculative_sampling(
        draft_probs, draft_ids.to(torch.int32), target_probs, accepted, emitted,
        deterministic=True, seed=seed, offset=offset)
    return tokens.to(torch.int64)


@chain_speculative_sampling.register_fake
def _(draft_probs, draft_ids, target_probs, seed, offset):
    return draft_ids.new_empty(draft_ids.shape[0], draft_ids.shape[1] + 1, dtype=torch.int64)
