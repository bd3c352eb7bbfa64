"""The executor's memory over time, in one process: an OfflineEngine with the bundled model
runs random batches (1-16 requests, prompts of 8-300 tokens, 4-32 output tokens, seeded), and
the process's RSS is printed every 10 batches.

    .venv/bin/python loadtest/rss_probe.py --dtype bfloat16 --seconds 300
    .venv/bin/python loadtest/rss_probe.py --dtype bfloat16 --seconds 100 --fixed

--fixed runs the same shape every batch (8 requests of 64 prompt tokens, 16 outputs): memory
that grows with random shapes and not with fixed ones is kept per shape. docs/executor.md
reports what it found (oneDNN's per-shape primitives).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine import OfflineEngine  # noqa: E402
from services.executor.config import ExecutorConfig  # noqa: E402
from shared.messages import SamplingParams  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--fixed", action="store_true", help="one shape every batch")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    engine = OfflineEngine(ExecutorConfig(dtype=args.dtype, kv_cache_gib=0.25))
    rng = random.Random(args.seed)
    start = time.time()
    batches = 0
    while time.time() - start < args.seconds:
        k = 8 if args.fixed else rng.randint(1, 16)
        reqs = []
        for _ in range(k):
            n = 64 if args.fixed else rng.randint(8, 300)
            out = 16 if args.fixed else rng.randint(4, 32)
            reqs.append(engine.request([rng.randint(100, 20000) for _ in range(n)],
                                       SamplingParams(max_tokens=out), ignore_eos=True))
        engine.generate(reqs)
        batches += 1
        if batches % 10 == 0:
            print(json.dumps({"s": round(time.time() - start), "batches": batches,
                              "rss_mib": round(rss_mib())}), flush=True)


if __name__ == "__main__":
    main()
