"""Fair admission between API keys under `pagedserve serve`: one key floods with n=16
requests while another sends one short request at a time.

    .venv/bin/python loadtest/bench_fairness.py                 # both stacks, one JSON line each
    .venv/bin/python loadtest/bench_fairness.py --stacks limits --flooders 8 --rounds 15

Each stack (with no per-key limit, then with --key-max-requests / --key-max-tokens) first
measures the calm key's time to first token alone (idle), then again while the flooding
key's threads each send n=16 requests back to back (retrying after Retry-After when
refused). Reported: the calm key's p50 TTFT idle and under the flood, their ratio (the
goal: at most 2), and the flood's accepted and refused requests. Figures:
docs/reliability.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.docgen import commit, cpu  # noqa: E402
from tests.serve_stack import Serve  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"calm": "sk-calm", "flood": "sk-flood"}
# One n=16 request of the flood (16 x 64 tokens + its prompt) fits the token budget, two do not.
LIMITS = ["--key-max-requests", "4", "--key-max-tokens", "1200"]


def ttft(client: httpx.Client, prompt: str) -> float:
    """Seconds from sending a streamed request to its first text chunk."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "stream": True}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {KEYS['calm']}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():         # to the end: the request then no longer counts
            if first is None and line.startswith("data: {") and '"text":""' not in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no token came")
    return first


def calm_p50(url: str, rounds: int, think_s: float) -> float:
    """The calm key's p50 TTFT over `rounds` requests, one at a time, each sent after a
    think time drawn uniformly from [0, think_s] (seeded): a user's next request arrives at
    any moment of the flood's step cycle, not always just after the step that finished its
    previous answer."""
    rng = random.Random(0)
    times = []
    with httpx.Client(base_url=url, timeout=300) as c:
        ttft(c, "Warm-up.")
        for i in range(rounds):
            time.sleep(rng.uniform(0.0, think_s))
            times.append(ttft(c, f"Question {i}: what is a river?"))
    return statistics.median(times)


def flood(url: str, stop: threading.Event, counts: dict) -> None:
    body = {"model": MODEL, "prompt": "Write a long story about the sea.", "n": 16,
            "max_tokens": 64, "temperature": 1.0, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=600) as c:
        while not stop.is_set():
            r = c.post("/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {KEYS['flood']}"})
            key = "accepted" if r.status_code == 200 else str(r.status_code)
            counts[key] = counts.get(key, 0) + 1
            if r.status_code in (429, 503):
                stop.wait(float(r.headers.get("retry-after", "1")))


def scenario(name: str, flags: list[str], flooders: int, rounds: int, think_s: float) -> dict:
    s = Serve(*flags, env={"PAGEDSERVE_API_KEYS": ",".join(KEYS.values())}).wait_healthy()
    try:
        idle = calm_p50(s.base_url, rounds, think_s)
        stop, counts = threading.Event(), {}
        threads = [threading.Thread(target=flood, args=(s.base_url, stop, counts), daemon=True)
                   for _ in range(flooders)]
        for t in threads:
            t.start()
        time.sleep(5.0)                      # the flood fills the batch first
        flooded = calm_p50(s.base_url, rounds, think_s)
        stop.set()
        for t in threads:
            t.join(timeout=600)
        return {"stack": name, "flags": " ".join(flags), "calm_p50_idle_s": round(idle, 3),
                "calm_p50_flood_s": round(flooded, 3), "ratio": round(flooded / idle, 2),
                "think_ms": think_s * 1e3, "flood_requests": counts, "load_average": os.getloadavg(), "cpu": cpu(),
                "commit": commit()}
    finally:
        s.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flooders", type=int, default=8, help="threads of the flooding key")
    p.add_argument("--rounds", type=int, default=15, help="calm requests per p50")
    p.add_argument("--think-ms", type=float, default=200.0,
                   help="the calm key's think time before each request: uniform in [0, this]")
    p.add_argument("--stacks", choices=["both", "limits", "none"], default="both",
                   help="which stacks: without per-key limits, with them, or both")
    a = p.parse_args()
    stacks = [("no per-key limit", []), ("per-key limits", LIMITS)]
    for name, flags in {"both": stacks, "none": stacks[:1], "limits": stacks[1:]}[a.stacks]:
        print(json.dumps(scenario(name, flags, a.flooders, a.rounds, a.think_ms / 1e3)),
              flush=True)


if __name__ == "__main__":
    main()
