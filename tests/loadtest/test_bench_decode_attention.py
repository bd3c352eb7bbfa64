"""bench_decode_attention runs the C decode kernel over an fp32 and a bf16 cache of the
same shape and reports each one's time and bytes read."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.executor import cpu_kernels

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--batch", "4", "--context", "40", "--layers", "2", "--reps", "2", "--rounds", "2"]


def _bench(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "loadtest/bench_decode_attention.py", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: no C kernels")
def test_bench_decode_attention_times_both_caches():
    proc = _bench(*SMALL, "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert set(out["ms_per_step"]) == {"float32", "bfloat16"}
    assert all(len(v) == 2 and min(v) > 0 for v in out["ms_per_step"].values())
    # bytes read: 2 layers x 4 seqs x 40 tokens x (K, V) x 3 heads x 64, at 4 or 2 bytes
    fp32_bytes = 2 * 4 * 40 * 2 * 3 * 64 * 4
    ms = out["ms_per_step_median"]["float32"]
    assert out["gb_per_s"]["float32"] == pytest.approx(fp32_bytes / (ms / 1e3) / 1e9)
    assert out["speedup_bf16"] == pytest.approx(ms / out["ms_per_step_median"]["bfloat16"])


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: no C kernels")
def test_bench_decode_attention_times_a_revision_beside_the_current_kernel():
    proc = _bench(*SMALL, "--baseline", "HEAD", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    base = json.loads(proc.stdout)["baseline"]
    assert base["rev"] == "HEAD"
    assert all(len(v) == 2 and min(v) > 0 for v in base["ms_per_step"].values())
    assert set(base["speedup"]) == {"float32", "bfloat16"}


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: no C kernels")
def test_bench_decode_attention_times_the_heads_together_and_one_at_a_time():
    proc = _bench(*SMALL, "--heads-at-once", "4,1", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["heads_at_once"] == 4
    by = out["by_heads_at_once"]
    assert by["4"]["ms_per_step"] == out["ms_per_step"]
    assert all(len(v) == 2 and min(v) > 0 for v in by["1"]["ms_per_step"].values())
    for k in ("float32", "bfloat16"):
        assert out["vs_first"]["1"][k] == pytest.approx(
            by["1"]["ms_per_step_median"][k] / out["ms_per_step_median"][k])
    bad = _bench("--heads-at-once", "4,0", timeout=60)
    assert bad.returncode == 2 and "--heads-at-once" in bad.stderr
    assert "Traceback" not in bad.stderr
