"""The Triton launches of an interpreted run, compiled for a Hopper GPU on this machine (no GPU needed).

Triton's CPU interpreter runs a kernel's Python, not Triton's compiler, so a kernel the interpreter accepts can
still fail to compile (a loop-carried value that changes type, a construct the compiler rejects), and its GPU
branches (the ``CUDA`` and ``PDL`` constants) never run there. :func:`recording` (inside ``TRITON_INTERPRET=1``)
keeps one record per distinct kernel, argument types, constants and launch options; ``python -m
tests.kernels.launches FILE`` (without the interpreter) compiles each record for sm_90 through Triton's own
compiler and ptxas, with ``CUDA`` and ``PDL`` set, and prints one line per kernel.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")  # launch keywords that are compile options
GPU_ONLY = ("CUDA", "PDL")  # constants the interpreter runs as False: compiled with their GPU branch


class Launch(NamedTuple):
    """One distinct launch: the kernel's module and name, each parameter's Triton type ("constexpr" for
    constants), the constants' values and the compile options."""
    module: str
    name: str
    types: tuple[tuple[str, str], ...]
    constants: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, object], ...]


def _launch(fn, args: tuple, kwargs: dict) -> Launch:
    from triton.runtime.jit import mangle_type

    signature = inspect.signature(fn)
    params = signature.parameters
    bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in params})
    types, constants = [], []
    for name, param in params.items():
        value = bound.arguments.get(name, param.default)
        if "constexpr" in str(param.annotation) or value is None:
            types.append((name, "constexpr"))
            constants.append((name, value))
        else:
            types.append((name, mangle_type(value)))
    options = tuple((k, kwargs[k]) for k in OPTIONS if k in kwargs)
    return Launch(fn.__module__, fn.__name__, tuple(types), tuple(constants), options)


@contextlib.contextmanager
def recording(launches: set[Launch]) -> Iterator[None]:
    """Inside: every interpreted kernel launch adds its :class:`Launch` to ``launches``."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recorded(self, *args, grid, warmup, **kwargs):
        launches.add(_launch(self.fn, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    InterpretedFunction.run = recorded
    try:
        yield
    finally:
        InterpretedFunction.run = run


def save(launches: set[Launch], path: Path) -> None:
    path.write_bytes(pickle.dumps(sorted(launches, key=repr)))


def compile_all(path: Path) -> None:
    """Compile every launch saved at ``path`` for sm_90; the first failure raises, naming the launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for launch in pickle.loads(path.read_bytes()):
        kernel = getattr(importlib.import_module(launch.module), launch.name)
        constants = {k: (True if k in GPU_ONLY else v) for k, v in launch.constants}
        try:
            triton.compile(ASTSource(kernel, dict(launch.types), constants), target=GPUTarget("cuda", 90, 32),
                           options=dict(launch.options))
        except Exception as error:
            raise RuntimeError(f"{launch.module}.{launch.name} does not compile for sm_90 with {constants} "
                               f"{dict(launch.options)}") from error
        print(f"ok compile {launch.module}.{launch.name}", flush=True)


if __name__ == "__main__":
    compile_all(Path(sys.argv[1]))
