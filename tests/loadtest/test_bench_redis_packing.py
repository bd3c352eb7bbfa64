"""bench_redis_packing times redis-py's packers against CommandPacker on the output path's
two commands, after checking that both give the same bytes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_redis_packing_reports_both_commands():
    proc = subprocess.run([sys.executable, "loadtest/bench_redis_packing.py", "--outputs", "8",
                           "--number", "5", "--rounds", "2", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["outputs"] == 8
    for name in ("scheduler_evalsha", "gateway_xread"):
        r = out[name]
        assert r["us_per_command"]["before"] > 0 and r["us_per_command"]["after"] > 0
        assert abs(r["us_per_output"]["after"] * 8 - r["us_per_command"]["after"]) < 1e-6
        assert r["speedup"] == r["us_per_command"]["before"] / r["us_per_command"]["after"]
