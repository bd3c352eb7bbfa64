"""What an open dashboard costs the stack: throughput with one dashboard stream open vs none.

One `pagedserve serve` stack, one workload (bench_overhead's: same prompt token ids, greedy,
fixed output length, concurrent streaming clients), run in alternating rounds: no dashboard,
dashboard open, no dashboard, ... An open dashboard is a separate process reading
`GET /dashboard/stream` (what a browser's EventSource does), so the gateway relays and the
scheduler builds and publishes snapshots at their full rate (4 a second) throughout the
round; the renderer itself runs in the operator's browser, not on the server. Alternating
rounds cancel the drift of a shared machine. Also printed: the time to build one snapshot of
a large pool (the only work the scheduler's loop does for a dashboard).

    python loadtest/bench_dashboard.py [--requests 32] [--output-tokens 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from loadtest.bench_overhead import _one, workload  # noqa: E402
from services.launcher import Stack, build_parser, free_port, free_ports  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from services.scheduler.scheduler import Scheduler  # noqa: E402
from services.scheduler.snapshot import MAX_SHARE, build_snapshot  # noqa: E402
from shared.dashboard import PUBLISH_HZ, encode_snapshot  # noqa: E402

# The open page: counts the snapshot events it receives, prints the count when stopped.
READER = """
import signal, sys, urllib.request
n = 0
def done(*_):
    print(n, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
for line in urllib.request.urlopen(sys.argv[1] + "/dashboard/stream"):
    if line.startswith(b"event: snapshot"):
        n += 1
"""


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def snapshot_cost(num_blocks: int, reps: int = 20) -> tuple[float, int]:
    """(ms to build and encode one snapshot, its bytes) of a pool with about 3/4 of its
    blocks in use, in scattered runs, and a tenth of them shared."""
    sched = Scheduler(SchedulerConfig(), num_blocks, num_blocks // 8)
    gpu = sched.block_manager.gpu
    rng = random.Random(0)
    for _ in range(num_blocks * 3 // 4):
        b = gpu.allocate()
        if rng.random() < 0.1:
            gpu.touch(b)
    for b in rng.sample(range(num_blocks), num_blocks // 8):      # scatter the free list
        if gpu.ref_count[b]:
            gpu.release(b)
    t0 = time.perf_counter()
    for _ in range(reps):
        data = encode_snapshot(build_snapshot(sched, "bench"))
    return 1000 * (time.perf_counter() - t0) / reps, len(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each kind, alternating")
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    prompts = workload(args.requests, args.seed)
    sargs = build_parser().parse_args([
        "serve", "--port", str(free_port()), "--grpc-port", str(free_port()),
        "--zmq-port", str(free_ports(2)), "--device", "cpu", "--dtype", "float32",
        "--kv-cache-gib", str(args.kv_gib), "--log-level", "warning", "--max-queue", "100000"])
    walls: dict[bool, list[float]] = {False: [], True: []}
    sched_cpu: dict[bool, float] = {False: 0.0, True: 0.0}
    snapshots_seen = 0
    with Stack(sargs) as stack:
        url = stack.start()
        sched_pid = next(p.pid for name, p in stack.procs if name == "scheduler")

        port = stack.args.port

        async def batch() -> float:
            # the lean raw-socket clients of bench_overhead (loadtest/sse_client.py)
            t0 = time.time()
            res = await asyncio.gather(*[_one(port, p, args.output_tokens, t0)
                                         for p in prompts])
            if any(first is None for first, _, _ in res):
                raise SystemExit("bench_dashboard: a request streamed nothing")
            return time.time() - t0

        asyncio.run(batch())                                     # warm-up
        for _ in range(args.rounds):
            for open_page in (False, True):
                reader = None
                if open_page:
                    reader = subprocess.Popen([sys.executable, "-c", READER, url],
                                              stdout=subprocess.PIPE, text=True)
                    time.sleep(1.5)      # the scheduler notices the watchers key within 1 s
                cpu0 = cpu_seconds(sched_pid)
                walls[open_page].append(asyncio.run(batch()))
                sched_cpu[open_page] += cpu_seconds(sched_pid) - cpu0
                if reader is not None:
                    reader.send_signal(signal.SIGTERM)
                    out, _ = reader.communicate(timeout=10)
                    snapshots_seen += int(out.strip() or 0)
    tokens = args.requests * args.output_tokens
    tok_s = {k: tokens * len(v) / sum(v) for k, v in walls.items()}
    # each open round against the closed round just before it: drift of the machine cancels
    pair = statistics.median(n / o for n, o in zip(walls[False], walls[True]))
    ms, size = snapshot_cost(100_000)
    share = min(ms / 1000 * PUBLISH_HZ, 1 / MAX_SHARE)
    # the scheduler process's CPU time per generated token: the loop's own cost, which the
    # machine's other load changes much less than it changes wall time
    us_tok = {k: 1e6 * v / (tokens * args.rounds) for k, v in sched_cpu.items()}
    out = {"open_over_none": tok_s[True] / tok_s[False], "paired_median": pair,
           "scheduler_cpu_us_per_token_none": us_tok[False],
           "scheduler_cpu_us_per_token_open": us_tok[True],
           "none_tok_s": tok_s[False],
           "open_tok_s": tok_s[True], "rounds": args.rounds, "requests": args.requests,
           "output_tokens": args.output_tokens, "snapshots_received": snapshots_seen,
           "snapshot_ms_100k_blocks": ms, "snapshot_bytes_100k_blocks": size,
           "loop_share_100k_blocks": share,
           "cpu": cpu_name()}
    if args.json:
        print(json.dumps(out))
        return
    print(f"CPU: {out['cpu']}")
    print(f"{args.rounds} rounds of each, {args.requests} requests x {args.output_tokens} tokens")
    print(f"no dashboard        {tok_s[False]:8.1f} tok/s  (walls {['%.2f' % w for w in walls[False]]})")
    print(f"one dashboard open  {tok_s[True]:8.1f} tok/s  (walls {['%.2f' % w for w in walls[True]]}; "
          f"{snapshots_seen} snapshots received)")
    print(f"open / none throughput: {out['open_over_none']:.3f} over all rounds; "
          f"{pair:.3f} median of the adjacent pairs")
    print(f"scheduler CPU per generated token: {us_tok[False]:.0f} us without, "
          f"{us_tok[True]:.0f} us with the dashboard open ({us_tok[True] / us_tok[False]:.3f}x)")
    print(f"one snapshot of a 100000-block pool: {ms:.1f} ms to build and encode, {size} bytes; "
          f"at most {100 * share:.1f}% of the scheduler loop while a page is open")


if __name__ == "__main__":
    main()
