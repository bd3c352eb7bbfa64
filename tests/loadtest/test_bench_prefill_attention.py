"""bench_prefill_attention times the C prefill kernel and SDPA on the same chunks, fresh
and continuing, in both dtypes, and reports each median with their ratio."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.executor import cpu_kernels

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: no C kernels")
def test_bench_prefill_attention_times_kernel_and_sdpa():
    proc = subprocess.run(
        [sys.executable, "loadtest/bench_prefill_attention.py", "--lengths", "16,48",
         "--chunk", "32", "--rounds", "2", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    # fresh chunks of 16 and 48; a continuing chunk only where the context exceeds the chunk
    got = {(r["kind"], r["dtype"], r["length"]) for r in out["rows"]}
    assert got == {("fresh", dt, n) for dt in ("float32", "bfloat16") for n in (16, 48)} | {
        ("continuing", dt, 48) for dt in ("float32", "bfloat16")}
    for r in out["rows"]:
        assert r["kernel_us"] > 0 and r["sdpa_us"] > 0
        assert r["sdpa_over_kernel"] == pytest.approx(r["sdpa_us"] / r["kernel_us"], rel=0.03)   # both rounded
