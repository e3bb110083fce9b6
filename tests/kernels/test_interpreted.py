"""The Triton kernels against their torch references under Triton's CPU interpreter (runs where triton is
installed; CI has no GPU, so this is where the kernels' logic is checked between GPU sessions), then every distinct
launch of that run compiled for sm_90 by Triton's compiler (tests/kernels/launches.py: what the interpreter does not
check)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # every kernel under Triton's interpreter, then compiled: minutes on two cores
def test_kernels_match_references_under_the_interpreter_and_compile_for_hopper(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    launches = tmp_path / "launches.pickle"
    result = subprocess.run([sys.executable, "-m", "tests.kernels.interpreted", str(launches)], check=False,
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.count("ok paged_attention") == 96
    assert result.stdout.count("ok split paged_attention") == 64 and result.stdout.count("ok merge_splits") == 8
    assert result.stdout.count("ok tree paged_attention") == 12
    assert result.stdout.count("ok auto split paged_attention") == 8
    assert result.stdout.count("ok pinned tree paged_attention") == 2
    for rows in (16, None, 128):  # row blocks of 16, the kernel's choice, one program (the wide tile)
        assert result.stdout.count(f"ok wide tree paged_attention rows={rows} ") == 4
    assert result.stdout.count("ok skinny_linear") == 48 and result.stdout.count("ok epilogue skinny_linear") == 32
    assert result.stdout.count("ok rotary skinny_linear") == 32
    assert result.stdout.count("ok rms_norm") == 8 and result.stdout.count("ok move_rows") == 16
    assert result.stdout.count("ok uniform") == 16
    assert result.stdout.count("ok silu_mul") == 8 and result.stdout.count("ok rotary tokens") == 16
    assert result.stdout.count("ok moe_align") == 28 and result.stdout.count("ok fused_moe") == 36
    assert result.stdout.count("ok moe_topk") == 24 and result.stdout.count("ok router_logits") == 24
    assert result.stdout.count("ok qk_norm_rotary") == 12
    assert result.stdout.count("ok engine") == 2
    compiler_env = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
    compiled = subprocess.run([sys.executable, "-m", "tests.kernels.launches", str(launches)], check=False, cwd=ROOT,
                              env=compiler_env, capture_output=True, text=True, timeout=900)
    assert compiled.returncode == 0, compiled.stdout[-2000:] + compiled.stderr[-4000:]
    kernels = {line.split()[-1] for line in compiled.stdout.splitlines() if line.startswith("ok compile ")}
    recorded = int(re.search(r"recorded (\d+) distinct launches", result.stdout).group(1))
    assert len(kernels) == 17 and compiled.stdout.count("ok compile ") == recorded > 100
