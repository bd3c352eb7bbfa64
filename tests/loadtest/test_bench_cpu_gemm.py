"""bench_cpu_gemm times the engine's GEMM beside the libraries, and with --baseline REV
the kernel of another revision, built apart, in the same turns."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.executor import cpu_kernels

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not cpu_kernels.linear_available(),
                    reason="the engine's GEMM needs a C compiler and AVX-512 or AVX2")
def test_bench_cpu_gemm_times_a_revision_beside_the_current_kernel():
    proc = subprocess.run(
        [sys.executable, "loadtest/bench_cpu_gemm.py", "--rows", "16", "--layers", "1",
         "--reps", "2", "--bf16", "--baseline", "HEAD", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    gflops = out["gflops"]["16"]
    assert gflops["engine@HEAD"] > 0 and gflops["engine_bf16@HEAD"] > 0
    ratios = out["vs_baseline"]["16"]
    assert set(ratios) >= {"engine", "engine_bf16"}
    assert ratios["engine"] == pytest.approx(gflops["engine"] / gflops["engine@HEAD"])
    assert "against HEAD: engine" in proc.stderr
