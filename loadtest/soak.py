"""Bounded soak: Locust at saturation against a fresh local stack, then the health figures.

It starts `pagedserve serve` (its own Redis), runs Locust headless for --minutes with more
users than the engine can serve at once (so the queue limit is hit and 429s are expected),
samples every service's RSS, and at the end reports:

  - failed requests other than the intended 429s (must be 0);
  - RSS growth of each service from the end of warm-up to the end (must be < 10 %);
  - KV blocks in use once the load stops (must be 0).

    python loadtest/soak.py --minutes 10 --users 64 --max-queue 32 [--json]

It stops by itself; traffic goes to 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.launcher import Stack, _free_port, build_parser  # noqa: E402


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--warmup-s", type=float, default=60)
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--max-queue", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    port = _free_port()
    stack = Stack(build_parser().parse_args([
        "serve", "--port", str(port), "--grpc-port", str(_free_port()), "--zmq-port",
        str(_free_port()), "--device", "cpu", "--kv-cache-gib", "0.25",
        "--max-queue", str(args.max_queue), "--log-level", "warning"]))
    url = stack.start()
    pids = {name: p.pid for name, p in stack.procs}
    samples: list[tuple[float, dict]] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((time.monotonic(), {n: rss_mib(p) for n, p in pids.items()}))
            stop.wait(5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out_dir = tempfile.mkdtemp(prefix="soak-")
    env = dict(os.environ, PAGEDSERVE_LOADTEST_MAX_TOKENS=str(args.max_tokens))
    started = time.monotonic()
    try:
        subprocess.run([sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest/locustfile.py"),
                        "--headless", "-u", str(args.users), "-r", str(args.users),
                        "-t", f"{int(args.minutes * 60)}s", "--stop-timeout", "60",
                        "--host", url, "--csv", f"{out_dir}/soak", "--only-summary"],
                       env=env, check=False, stdout=subprocess.DEVNULL)
        time.sleep(3)
        blocks = metric(url, "pagedserve:gpu_blocks_used")
        running = metric(url, "vllm:num_requests_running")
    finally:
        stop.set()
        sampler.join()
        stack.stop()

    failures = {}
    with open(f"{out_dir}/soak_failures.csv") as f:
        for row in csv.DictReader(f):
            failures[f"{row['Method']} {row['Name']}: {row['Error']}"] = int(row["Occurrences"])
    unintended = {k: v for k, v in failures.items() if "429" not in k}
    with open(f"{out_dir}/soak_stats.csv") as f:
        rows = list(csv.DictReader(f))
    total = next(r for r in rows if r["Name"] == "Aggregated")
    warm = [s for t, s in samples if t - started >= args.warmup_s] or [s for _, s in samples]
    growth = {n: 100 * (warm[-1][n] - warm[0][n]) / max(1e-9, warm[0][n]) for n in pids}
    result = {
        "minutes": args.minutes, "users": args.users,
        "requests": int(total["Request Count"]), "failures_total": int(total["Failure Count"]),
        "failures_unintended": sum(unintended.values()), "failure_kinds": failures,
        "rss_start_mib": warm[0], "rss_end_mib": warm[-1], "rss_growth_pct": growth,
        "kv_blocks_in_use_after": blocks, "running_after": running,
    }
    ok = (result["failures_unintended"] == 0 and max(growth.values()) < 10 and blocks == 0)
    result["pass"] = ok
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
