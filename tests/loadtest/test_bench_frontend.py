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
         "--rate", "400", "--tokens", str(TOKENS), "--processes", "1", "--socket-times",
         "--json"],
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
    # each token reached the client's socket before the client read it
    assert 0 <= run["added_ms_p50_at_socket"] <= run["added_ms_p50"]
    assert run["added_ms_p50_at_socket"] <= out["added_ms_p99_at_socket"] <= out["added_ms_p99"]


def test_repeated_cases_are_reported_by_their_medians():
    sys.path.insert(0, str(REPO))
    from loadtest.bench_frontend import medians

    def run(label, procs, gw, p99):
        return {"label": label, "processes": procs, "tokens_per_s": 1000.0 * gw,
                "cpu_us_per_token": {"gateway": gw, "redis": 2.0}, "added_ms_p99": p99}

    rows = [run("baseline", 1, 30.0, 9.0), run("current", 1, 20.0, 5.0),
            run("baseline", 1, 34.0, 30.0), run("current", 1, 26.0, 7.0),
            run("baseline", 1, 31.0, 12.0), run("current", 1, 21.0, 50.0),
            run("current", 2, 40.0, 8.0)]
    base, one, two = medians(rows)
    assert (base["label"], base["processes"], base["repeats"]) == ("baseline", 1, 3)
    assert base["cpu_us_per_token"] == {"gateway": 31.0, "redis": 2.0}
    assert base["added_ms_p99"] == 12.0 and base["tokens_per_s"] == 31000.0
    assert (one["label"], one["processes"], one["cpu_us_per_token"]["gateway"],
            one["added_ms_p99"]) == ("current", 1, 21.0, 7.0)
    assert two == rows[-1], "a case run once is reported as it ran"


def test_streams_the_gateway_refuses_end_the_run_in_one_line_not_a_wait():
    # max_tokens over the model's length: every request is refused with a 400, and the
    # token source, which waits for every stream to end, would wait for ever
    proc = subprocess.run(
        [sys.executable, "loadtest/bench_frontend.py", "--streams", "2", "--rate", "200",
         "--tokens", "100000", "--processes", "1", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "the gateway refused 2 of 2 streams (HTTP 400" in proc.stderr
