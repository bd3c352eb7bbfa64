"""bench_frontend runs end to end on a small load: its own Redis, the real gateway process,
the token source (the scheduler's RedisLink) and the streaming clients, and every token
the source publishes reaches a client."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STREAMS, TOKENS = 4, 12


def test_bench_frontend_delivers_every_published_token_and_counts_each_process():
    proc = subprocess.run(
        [sys.executable, "loadtest/bench_frontend.py", "--streams", str(STREAMS),
         "--rate", "400", "--tokens", str(TOKENS), "--processes", "1", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (run,) = out["runs"]
    assert run["errors"] == 0
    assert run["tokens"] == STREAMS * TOKENS
    assert out["tokens_per_s_one_process"] > 0
    assert set(out["tokens_per_s_by_processes"]) == {"1"}
    assert set(out["cpu_us_per_token"]) == {"gateway", "redis", "source", "clients"}
    assert out["cpu_us_per_token"]["gateway"] > 0
    assert 0 <= out["added_ms_p50"] <= out["added_ms_p99"]
