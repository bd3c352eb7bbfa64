"""Bounded soak: Locust at saturation against a fresh local stack, then the health figures.

It starts `pagedserve serve` (its own Redis unless REDIS_URL is set), runs Locust headless
for --minutes with more users than the queue admits (--users > --max-queue, so the
gateway's 429 limit is hit all along: saturation), samples every service's RSS every 5 s,
and at the end reports:

  - failed requests other than the intended 429s (must be 0);
  - RSS growth of each service from the end of warm-up to the end of the load (< 10 %);
  - KV blocks in use (GPU and CPU swap) once the load stops (must be 0);
  - that every service is still running.

    python loadtest/soak.py --minutes 10 --users 64 --max-queue 32 --write-docs

--write-docs records the figures in docs/soak.md. The exit status is 0 only when every
criterion holds. SIGTERM or Ctrl-C stops the stack and Locust before exiting. Traffic goes
to 127.0.0.1 only.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.docgen import commit, machine, metric, write_block  # noqa: E402
from services.launcher import Stack, build_parser, free_port, free_ports  # noqa: E402

SAMPLE_S = 5.0          # RSS sampling period (s)
SETTLE_S = 30.0         # after the load: wait this long at most for the pool to drain (s)


def rss_mib(pid: int) -> float:
    """Resident set size of one process (MiB); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


DRAIN = ("pagedserve:gpu_blocks_used", "pagedserve:cpu_blocks_used",
         "vllm:num_requests_running", "vllm:num_requests_waiting")


def drained(url: str) -> dict[str, float]:
    """The pool and batch gauges, polled until all are 0 or SETTLE_S has passed."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        values = {name: metric(url, name) for name in DRAIN}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(1)


def locust_figures(out_dir: str) -> dict:
    """Requests and failures of the HTTP requests (not the TTFT/ITL entries the locustfile
    adds), with the failures split into intended 429s and the rest."""
    with open(f"{out_dir}/soak_stats.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["Type"] == "POST"]
    failures: dict[str, int] = {}
    with open(f"{out_dir}/soak_failures.csv") as f:
        for row in csv.DictReader(f):
            key = f"{row['Method']} {row['Name']}: {row['Error']}"
            failures[key] = failures.get(key, 0) + int(row["Occurrences"])
    # the locustfile reports a non-200 status as "HTTP <status>: <body>"
    rejected = sum(v for k, v in failures.items() if "HTTP 429:" in k)
    return {"requests": sum(int(r["Request Count"]) for r in rows),
            "failures_total": sum(int(r["Failure Count"]) for r in rows),
            "rejected_429": rejected,
            "failures_unintended": sum(failures.values()) - rejected,
            "failure_kinds": {k: v for k, v in failures.items() if "HTTP 429:" not in k},
            "served": sum(int(r["Request Count"]) - int(r["Failure Count"]) for r in rows)}


def soak(args) -> dict:
    flags = ["serve", "--port", str(free_port()), "--grpc-port", str(free_port()),
             "--zmq-port", str(free_ports(2)), "--device", args.device,
             "--kv-cache-gib", str(args.kv_cache_gib), "--max-queue", str(args.max_queue),
             "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning"]
    with Stack(build_parser().parse_args(flags)) as stack:
        url = stack.start()
        print(f"soak: stack up at {url}; {args.users} users for {args.minutes:g} min",
              file=sys.stderr, flush=True)
        pids = {name: p.pid for name, p in stack.procs}
        samples: list[tuple[float, dict]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic(), {n: rss_mib(p) for n, p in pids.items()}))
                stop.wait(SAMPLE_S)

        sampler = threading.Thread(target=sample, daemon=True)
        out_dir = tempfile.mkdtemp(prefix="soak-")
        env = dict(os.environ, PAGEDSERVE_LOADTEST_MAX_TOKENS=str(args.max_tokens))
        started = time.monotonic()
        sampler.start()
        try:
            subprocess.run([sys.executable, "-m", "locust",
                            "-f", str(ROOT / "loadtest/locustfile.py"), "--headless",
                            "-u", str(args.users), "-r", str(args.users),
                            "-t", f"{int(args.minutes * 60)}s", "--stop-timeout", "60",
                            "--host", url, "--csv", f"{out_dir}/soak", "--only-summary"],
                           env=env, check=False, stdout=subprocess.DEVNULL)
            load_ended = time.monotonic()
            after = drained(url)
            alive = {name: p.poll() is None for name, p in stack.procs}
        finally:
            stop.set()
            sampler.join()

    figures = locust_figures(out_dir)
    under_load = [s for t, s in samples if started + args.warmup_s <= t <= load_ended]
    if len(under_load) < 2:          # a run shorter than its warm-up: use the whole load
        under_load = [s for t, s in samples if t <= load_ended] or [s for _, s in samples]
    first, last = under_load[0], under_load[-1]
    growth = {n: 100 * (last[n] - first[n]) / max(1e-9, first[n]) for n in pids}
    peak = {n: max(s[n] for s in under_load) for n in pids}
    result = {
        "minutes": args.minutes, "users": args.users, "max_queue": args.max_queue,
        "max_num_seqs": args.max_num_seqs,
        "max_tokens": args.max_tokens, "warmup_s": args.warmup_s, **figures,
        "device": args.device,
        "requests_per_s": figures["requests"] / max(1e-9, load_ended - started),
        "served_per_s": figures["served"] / max(1e-9, load_ended - started),
        "rss_start_mib": first, "rss_end_mib": last, "rss_peak_mib": peak,
        "rss_growth_pct": growth, "after_load": after, "services_alive": alive,
        "locust_csv": out_dir,
    }
    result["checks"] = {
        "no_unintended_failures": figures["failures_unintended"] == 0,
        "saturated (some 429s)": figures["rejected_429"] > 0,
        "rss_growth_under_10pct": max(growth.values()) < 10,
        "zero_kv_blocks_in_use": after["pagedserve:gpu_blocks_used"] == 0
                                  and after["pagedserve:cpu_blocks_used"] == 0,
        "services_alive": all(alive.values()),
    }
    result["pass"] = all(result["checks"].values())
    return result


def write_docs(result: dict, command: str) -> Path:
    r = result
    lines = [
        "<!-- written by loadtest/soak.py --write-docs; edit the script, not this block -->",
        "## The run",
        "",
        "A fresh local stack under Locust at saturation, reproduced by:",
        "",
        f"    {command}",
        "",
        f"- code at commit {commit()}, on {machine(r['device'])}, device {r['device']}; "
        f"{r['users']} Locust users (a refused one retries after Retry-After), engine batch "
        f"{r['max_num_seqs']}, queue limit {r['max_queue']} (so 429s are intended), "
        f"max_tokens {r['max_tokens']}, {r['minutes']:g} min, warm-up {r['warmup_s']:g} s",
        f"- requests: {r['requests']} sent ({r['requests_per_s']:.2f}/s), {r['served']} "
        f"served ({r['served_per_s']:.2f}/s), {r['rejected_429']} answered 429, "
        f"**{r['failures_unintended']} other failures**",
        f"- after the load: {r['after_load']['pagedserve:gpu_blocks_used']:g} GPU and "
        f"{r['after_load']['pagedserve:cpu_blocks_used']:g} CPU KV blocks in use, "
        f"{r['after_load']['vllm:num_requests_running']:g} running, "
        f"{r['after_load']['vllm:num_requests_waiting']:g} waiting",
        "",
        "| service | RSS after warm-up (MiB) | RSS at the end (MiB) | growth | peak (MiB) |",
        "|---|---|---|---|---|",
    ]
    for n in r["rss_growth_pct"]:
        lines.append(f"| {n} | {r['rss_start_mib'][n]:.1f} | {r['rss_end_mib'][n]:.1f} | "
                     f"{r['rss_growth_pct'][n]:+.1f} % | {r['rss_peak_mib'][n]:.1f} |")
    lines += ["", "| criterion | holds |", "|---|---|"]
    lines += [f"| {k} | {'yes' if v else '**no**'} |" for k, v in r["checks"].items()]
    if r["failure_kinds"]:
        lines += ["", "Failures other than 429:", ""]
        lines += [f"- {k}: {v}" for k, v in r["failure_kinds"].items()]
    path = ROOT / "docs" / "soak.md"
    write_block(path, "soak", lines)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--warmup-s", type=float, default=150,
                    help="RSS growth is measured from this long after the start (longer than "
                         "the 120 s a finished request's output stream is kept in Redis)")
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--max-queue", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16,
                    help="the engine's batch: users beyond it + the queue limit get 429s")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--kv-cache-gib", type=float, default=0.25, help="KV pool on the CPU")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write-docs", action="store_true", help="record docs/soak.md")
    args = ap.parse_args()
    try:
        result = soak(args)
    except KeyboardInterrupt as exc:
        print(f"soak: interrupted ({exc or 'SIGINT'}); the stack was stopped", file=sys.stderr)
        return 130
    if args.write_docs:
        command = "python loadtest/soak.py " + " ".join(sys.argv[1:])
        print(f"soak: wrote {write_docs(result, command)}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
