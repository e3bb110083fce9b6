"""The compiled step's Dynamo traces kept on disk, so that a second process loads them instead of tracing again.

Inductor's cache already keeps the compiled kernels between processes, but Dynamo traced the step's Python
again in every process: most of a warm start. This torch's DynamoCache (``torch._dynamo.config
.caching_precompile``, experimental) keeps each compiled function's traced bytecode, guards and compiled graphs
under Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR/dynamo``; ``TLLM_SPEC_CACHE_DIR/inductor/dynamo``
with :mod:`tllm_spec.caches`) and loads them when the function is wrapped by torch.compile. A package whose
sources changed, or that was made by another torch, Python or GPU, is refused by torch and the step is traced
afresh.

``TLLM_SPEC_TRACE_CACHE=0`` turns this off. Seen working with torch 2.13 on the CPU (tests/test_trace_cache.py:
a second process traces nothing and every step equals the eager one) and with torch 2.11 on an H100 (the 8B shape's
warm-up in a second process: every trace loaded, none made, 1.8 s; the step as fast as one traced in process;
docs/benchmarks/README.md).

What the DynamoCache asks of its user, and how tllm_spec meets it:

- Its guards leave out object identities (``ID_MATCH``) and function identities, which cannot outlive a
  process. The step's traced code reads no per-model fact that only such a guard would tell apart: what
  differs between models (module types, shapes, integer and boolean attributes) keeps its guard.
- A package installs its guards with the autograd state of the moment it is loaded: the step is wrapped, and
  always called, under ``torch.inference_mode`` (:func:`compile`).
- A guard on the object ``torch.library.custom_op`` returns cannot be saved (it holds the dispatcher's library):
  compiled code calls tllm_spec's custom ops as ``torch.ops.tllm_spec.<name>``.
- The names of the globals Dynamo installs count up from 0 in every process, so a trace made after a package
  was loaded could take a name the package already installed; the counter starts at a random offset in a
  process that caches traces (:func:`_prepare_process`).
- It keeps one package per function, and a package can name only the resume functions (the code after a graph
  break) that its own traces made: a second torch.compile wrapper of the step in one process (two models, as the
  benchmark's plain and EAGLE-3 engines) failed with ``PackageError: Cannot resolve a fully qualified name for
  <code object torch_dynamo_resume_in_forward_at_49 ...>``. :func:`compile` makes one wrapper per function and
  options in a process that caches traces, and every caller shares it.
- torch warns once for every guard it leaves out of a package: hundreds of lines on a fresh start, and expected
  here (the first point). Those warnings are filtered out of ``torch._dynamo.guards``'s log; its others stay.
- A traced region without a single operation (a graph break's remainder that only returns a view of its input)
  failed to compile with ``AssertionError: expected OutputCode, got <class 'method'>`` (torch 2.11 on an H100,
  the second of two models in a process; torch 2.13 on the CPU for ``x[...]``): Inductor returns such a graph's
  ``forward`` uncompiled unless ``torch._functorch.config.bundled_autograd_cache`` is set, but the DynamoCache
  bundles AOTAutograd's entries whenever it is on, and a bundled entry needs compiled code. :func:`caching` sets
  that flag too.

Whatever else fails inside this experimental cache never reaches the user: a compiled function whose cached
compilation raises a Dynamo error is compiled again without the cache, the cache is off for the rest of the
process, and one warning names ``TLLM_SPEC_TRACE_CACHE`` (:func:`compile`).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import shutil
import warnings
from collections.abc import Callable, Iterator

import torch

TRACE_CACHE_VAR = "TLLM_SPEC_TRACE_CACHE"
_prepared = [False]  # _prepare_process ran in this process
_failed = [False]  # a compilation failed inside the cache in this process: compile without it from then on
_wrappers: dict[tuple[Callable, str], Callable] = {}  # (function, options) -> its one wrapper while caching


def enabled() -> bool:
    """Whether this process keeps the step's traces on disk: this torch has the DynamoCache and
    ``TLLM_SPEC_TRACE_CACHE`` is not "0"."""
    from torch._dynamo import bytecode_transformation

    return (not _failed[0] and os.environ.get(TRACE_CACHE_VAR, "1").strip() != "0"
            and hasattr(torch._dynamo.config, "caching_precompile")
            and hasattr(bytecode_transformation, "_unique_id_counter"))


@contextlib.contextmanager
def caching() -> Iterator[None]:
    """Inside: torch.compile wrappers made load their function's traces from disk, and traces made are recorded
    for :func:`save`. A no-op where :func:`enabled` is false."""
    if not enabled():
        yield
        return
    _prepare_process()
    with torch._dynamo.config.patch(caching_precompile=True), _bundled_entries():
        yield


def compile(fn: Callable, **options) -> Callable:
    """``torch.compile(fn, **options)``, its saved traces loaded (inside :func:`caching` and inference mode: the
    state the step runs in, which a loaded package's guards take from the moment they are installed); where traces
    are cached, the same wrapper for every call with this function and options in the process. A package that
    fails to load (torch raises while installing its guards) is deleted with a warning, and ``fn`` is traced
    afresh and saved again. A call whose compilation fails inside the cache (a Dynamo error) turns the cache off
    for the process with one warning and runs ``fn`` through a plain ``torch.compile``, as every wrapper's later
    calls do."""
    if not enabled():
        return _compile_loading(fn, **options)
    key = (fn, repr(sorted(options.items())))
    if key not in _wrappers:
        _wrappers[key] = _falling_back(fn, options, _compile_loading(fn, **options))
    return _wrappers[key]


def _falling_back(fn: Callable, options: dict, cached: Callable) -> Callable:
    """``cached`` (``fn`` compiled with the cache) until a compilation fails inside the cache in this process;
    a plain ``torch.compile(fn, **options)`` from then on."""
    plain: list[Callable] = []

    def run(*args, **kwargs):
        if not _failed[0]:
            try:
                return cached(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as err:  # raised while compiling, before any kernel ran
                _turn_off(fn, err)
        with torch._dynamo.config.patch(caching_precompile=False):  # a wrapper made while caching has a package
            if not plain:
                plain.append(torch.compile(fn, **options))
            return plain[0](*args, **kwargs)
    return run


def _turn_off(fn: Callable, err: Exception) -> None:
    _failed[0] = True
    cause = getattr(err, "inner_exception", None) or err  # BackendCompilerFailed wraps the backend's error
    lines = str(cause).strip().splitlines()
    warnings.warn(f"tllm_spec: compiling {fn.__qualname__} failed inside the trace cache ({type(cause).__name__}"
                  f"{': ' + lines[0] if lines else ''}); compiling without it for the rest of this process (set "
                  f"{TRACE_CACHE_VAR}=0 to turn it off)", stacklevel=4)


def reset() -> None:
    """Forget this process's traces (``torch._dynamo.reset``), wrappers and any failure: the next :func:`compile`
    loads its function's package from disk again."""
    _wrappers.clear()
    _failed[0] = False
    torch._dynamo.reset()


def _compile_loading(fn: Callable, **options) -> Callable:
    def wrap() -> Callable:
        with caching(), torch.inference_mode():
            return torch.compile(fn, **options)

    try:
        return wrap()
    except Exception as err:  # noqa: BLE001 - torch's package loader raises assorted errors on a bad package
        from torch._dynamo.package import CompilePackage, DynamoCache

        path = os.path.join(DynamoCache.path_prefix(), CompilePackage.source_id_from_fn(fn))
        warnings.warn(f"tllm_spec: the saved traces of {fn.__qualname__} could not be loaded ({type(err).__name__}: "
                      f"{err}); deleted {path}, tracing afresh", stacklevel=3)
        shutil.rmtree(path, ignore_errors=True)
        return wrap()


def compile_inside(fn: Callable, **options) -> Callable:
    """:func:`compile` where the caller is inside :func:`caching` (a function first compiled while a compiled
    step runs, as the fused layers are), else plain ``torch.compile``: a wrapper made while caching must also be
    compiled while caching, which a caller outside :func:`caching` (``torch._dynamo.explain``) is not."""
    if enabled() and torch._dynamo.config.caching_precompile:
        return compile(fn, **options)
    return torch.compile(fn, **options)


def save() -> bool:
    """Write the traces recorded in this process (loaded ones included) to disk, one package per compiled
    function (the last one recorded); whether anything was written. (Not through
    ``torch.compiler.save_cache_artifacts``, which would also serialise every compiled artifact of the process
    into bytes nobody reads: a process that builds many models, as the GPU tests do, would pay that again at every
    warm-up.)"""
    if not enabled():
        return False
    from torch._dynamo.package import DynamoCache
    from torch._dynamo.precompile_context import PrecompileContext

    with caching():
        entries, _ = PrecompileContext.create_cache_entries()
        for key, entry in entries.items():
            DynamoCache.write(entry, key)
    return bool(entries)


def _bundled_entries() -> contextlib.AbstractContextManager:
    """Inside: the functorch setting the DynamoCache needs for graphs without operations (see the module's
    docstring), where this torch has it."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "bundled_autograd_cache"):
        return contextlib.nullcontext()
    return functorch_config.patch(bundled_autograd_cache=True)


def _prepare_process() -> None:
    """Once per process: start Dynamo's counter of installed-global names at a random offset (names a loaded
    package installed came from another process's count, from 0, and must not be taken again), and filter the
    dropped-guard warnings out of torch's guard log."""
    if _prepared[0]:
        return
    from torch._dynamo import bytecode_transformation

    bytecode_transformation._unique_id_counter = itertools.count(secrets.randbits(40) + 1)
    logging.getLogger("torch._dynamo.guards").addFilter(_keep_unless_dropped_guard)
    _prepared[0] = True


def _keep_unless_dropped_guard(record: logging.LogRecord) -> bool:
    return "is dropped with caching_precompile" not in str(record.msg)
