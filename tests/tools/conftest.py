"""Fixtures shared by the tools' tests."""
import importlib.util
from pathlib import Path

import pytest

BENCHMARK_SCRIPT = Path(__file__).parents[2] / "scripts" / "benchmark.py"


@pytest.fixture(scope="module")
def script():
    """scripts/benchmark.py loaded as a module (its functions without a subprocess)."""
    spec = importlib.util.spec_from_file_location("benchmark_script", BENCHMARK_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
