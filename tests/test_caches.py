"""TLLM_SPEC_CACHE_DIR: one directory for the compile caches, applied when the package is imported."""
import os
import subprocess
import sys
from pathlib import Path

from tllm_spec.caches import CACHE_VARS, configure_caches

ROOT = Path(__file__).resolve().parents[1]


def test_each_cache_gets_its_directory_unless_already_set(tmp_path):
    environ = {"TLLM_SPEC_CACHE_DIR": str(tmp_path), "TRITON_CACHE_DIR": "/mine"}
    chosen = configure_caches(environ)
    assert chosen == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                      "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "flashinfer")}
    assert environ["TRITON_CACHE_DIR"] == "/mine" and environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")


def test_nothing_changes_without_the_variable():
    environ = {"TLLM_SPEC_CACHE_DIR": " "}
    assert configure_caches(environ) == {} and environ == {"TLLM_SPEC_CACHE_DIR": " "}


def test_importing_the_package_applies_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARS}
    env.update(TLLM_SPEC_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    code = "import os, tllm_spec; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(tmp_path / "inductor")
