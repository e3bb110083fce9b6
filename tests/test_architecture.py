"""The package's shape: no import cycle between its modules (function-level and TYPE_CHECKING imports
counted), small modules, a short root, and a core that never imports the tooling or the training code."""
from __future__ import annotations

import ast
from pathlib import Path

import tllm_spec

PACKAGE = Path(tllm_spec.__file__).parent
ABOVE_THE_CORE = ("tllm_spec.tools", "tllm_spec.training")
FRONT_ENDS = ("tllm_spec.serve",)  # above the core too: the server's CLI may run a tool (bench-serve)
MAX_MODULE_LINES = 350
MAX_ROOT_MODULES = 12


def _module_name(path: Path) -> str:
    parts = ("tllm_spec",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path) -> set[str]:
    """Every tllm_spec module ``name`` imports, wherever the import statement stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names}
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _find_cycle() -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep, stack + [dep])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(GRAPH):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_import_graph_sees_relative_function_level_and_type_checking_imports():
    assert "tllm_spec.one_model" in GRAPH["tllm_spec.engine.runner"]  # from ..one_model import OneModel
    assert "tllm_spec.guided.grammar" in GRAPH["tllm_spec.engine.request"]  # under TYPE_CHECKING
    assert "tllm_spec.kernels.dependent_launch" in GRAPH["tllm_spec.kernels.rms_norm"]  # from . import x


def test_no_import_cycle():
    assert _find_cycle() is None, " -> ".join(_find_cycle())


def test_the_core_never_imports_tools_or_training():
    core = [n for n in GRAPH if not n.startswith(ABOVE_THE_CORE + FRONT_ENDS)]
    offenders = {n: sorted(d for d in GRAPH[n] if d.startswith(ABOVE_THE_CORE)) for n in core}
    assert not {n: d for n, d in offenders.items() if d}


def test_the_core_never_imports_the_server():
    core = [n for n in GRAPH if not n.startswith(ABOVE_THE_CORE + FRONT_ENDS)]
    assert not {n: d for n in core if (d := sorted(x for x in GRAPH[n] if x.startswith(FRONT_ENDS)))}


def test_training_never_imports_tools():
    offenders = {n: sorted(d for d in deps if d.startswith("tllm_spec.tools"))
                 for n, deps in GRAPH.items() if n.startswith("tllm_spec.training")}
    assert not {n: d for n, d in offenders.items() if d}


def test_modules_are_small():
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert not {n: s for n, s in sizes.items() if s > MAX_MODULE_LINES}


def test_the_root_is_short():
    root = [p.name for p in PACKAGE.glob("*.py")]
    assert len(root) <= MAX_ROOT_MODULES, root


def test_the_public_api_imports_from_the_package():
    from tllm_spec import (  # noqa: F401
        Eagle3Config,
        MTPConfig,
        SamplingParams,
        SpecMetadata,
        SpecModel,
        SpeculativeDecodingMode,
        SpecWorkerBase,
    )
