"""bench_startup starts `pagedserve serve`, times it to a healthy /health and reads each
service's memory."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_startup_times_serve_and_reads_every_service():
    proc = subprocess.run([sys.executable, "loadtest/bench_startup.py", "--rounds", "1",
                           "--json"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    (run,) = out["runs"]
    assert run["healthy_s"] > 0 and out["healthy_s_median"] == {run["label"]: run["healthy_s"]}
    services = run["services"]
    assert set(services) == {"executor", "scheduler", "gateway"}, services
    assert all(s["rss_mib"] > 0 for s in services.values())
    assert services["executor"]["torch"] and not services["gateway"]["torch"]
