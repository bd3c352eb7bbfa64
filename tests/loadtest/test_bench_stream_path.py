"""bench_stream_path runs the gateway's per-token path in one process: every stream gets one
event per token (the reader writes each through the body writer), then its last piece."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_stream_path_sends_an_event_per_token_and_hashes_them():
    streams, rounds = 8, 6
    proc = subprocess.run([sys.executable, "loadtest/bench_stream_path.py", "--streams",
                           str(streams), "--rounds", str(rounds), "--repeats", "1", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cur = json.loads(proc.stdout.strip().splitlines()[-1])["current"]
    # per stream: the response's start, one body piece per token, the closing [DONE]
    assert cur["sends"] == streams * (rounds + 2)
    assert cur["cpu_us_per_token"] > 0 and len(cur["sha256"]) == 16
