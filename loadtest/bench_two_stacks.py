"""Two `pagedserve serve` stacks on one host: what the host delivers with both busy.

Each stack is started as a user starts it (`python -m services.launcher serve`, its own
private Redis, free ports, the executor's default threads and OpenMP settings: nothing in
this process's environment about OpenMP reaches them). The same streaming workload
(random prompt token ids, greedy, exactly --output-tokens each) runs

  alone     on stack A while stack B idles
  together  on stack A and stack B at once

and `together_over_alone` is the output tok/s of both stacks together over stack A's alone:
1.0 when the host's cores serve two busy stacks as well as one, less when the two
executors slow each other down (services/executor/host_share.py, docs/overhead.md).

    python loadtest/bench_two_stacks.py [--requests 16] [--output-tokens 96] \
        [--baseline REV] [--rounds 2] [--json]

--baseline REV runs the same with the code of git revision REV (a temporary worktree), in
turn with the checkout, --rounds times each.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest import docgen, serve_proc  # noqa: E402
from loadtest.sse_client import stream_completion  # noqa: E402
from loadtest.workloads import random_prompts  # noqa: E402
from services.launcher import free_port, free_ports  # noqa: E402

OPENMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
IDLE_S = 3.0         # after the warm-ups, before A runs alone


def start(tree: Path, args) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARS}
    flags = ["--grpc-port", str(free_port()), "--zmq-port", str(free_ports(3)),
             "--device", "cpu", "--dtype", args.dtype, "--kv-cache-gib", "0.5",
             "--max-num-seqs", str(args.requests), "--log-level", "warning"]
    return serve_proc.start(tree, port, flags, env), port


async def _one(port: int, prompt: list[int], out_tokens: int) -> int:
    """The tokens one streamed request received (max_tokens with ignore_eos: all of them
    once it streamed text; the client counts characters, not tokens)."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": out_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    _rid, arrivals = await stream_completion("127.0.0.1", port, body)
    return out_tokens if arrivals else 0


async def _load(port: int, prompts, out_tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = await asyncio.gather(*[_one(port, p, out_tokens) for p in prompts])
    return sum(tokens), time.perf_counter() - t0


def measure(tree: Path, label: str, prompts, args) -> dict:
    (a, pa), (b, pb) = start(tree, args), start(tree, args)
    try:
        serve_proc.wait_healthy(a, pa)
        serve_proc.wait_healthy(b, pb)

        async def go():
            for port in (pa, pb):                       # warm-up: one short request each
                await _one(port, prompts[0], 4)
            # B idle from here: no executor counts it busy any more (host_share.BUSY_S)
            await asyncio.sleep(IDLE_S)
            alone = await _load(pa, prompts, args.output_tokens)
            t0 = time.perf_counter()
            both = await asyncio.gather(_load(pa, prompts, args.output_tokens),
                                        _load(pb, prompts, args.output_tokens))
            return alone, both, time.perf_counter() - t0

        (tok_alone, wall_alone), both, wall_both = asyncio.run(go())
    finally:
        serve_proc.stop(a)
        serve_proc.stop(b)
    expected = len(prompts) * args.output_tokens
    if tok_alone != expected or any(t != expected for t, _ in both):
        raise SystemExit(f"{label}: a request streamed no text "
                         f"({tok_alone}, {[t for t, _ in both]} of {expected})")
    alone = tok_alone / wall_alone
    together = sum(t for t, _ in both) / wall_both
    return {"label": label, "alone_tok_s": round(alone, 1),
            "together_tok_s": round(together, 1),
            "per_stack_tok_s": [round(t / w, 1) for t, w in both],
            "together_over_alone": round(together / alone, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--baseline", default=None, help="git revision to run in turn")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    prompts = random_prompts(args.requests, args.seed)
    rows = []
    with docgen.trees(args.baseline) as trees:
        for r in range(args.rounds):
            for tree, label in docgen.in_turn(trees, r):
                row = measure(tree, label, prompts, args)
                rows.append(row)
                if not args.json:
                    print(f"{label}: alone {row['alone_tok_s']} tok/s, together "
                          f"{row['together_tok_s']} ({row['per_stack_tok_s']}), "
                          f"{row['together_over_alone']}x", flush=True)
    labels = list(dict.fromkeys(r["label"] for r in rows))
    summary = {lab: round(statistics.median(r["together_over_alone"] for r in rows
                                            if r["label"] == lab), 3) for lab in labels}
    out = {"cpu": docgen.cpu(), "requests": args.requests,
           "output_tokens": args.output_tokens, "dtype": args.dtype, "runs": rows,
           "together_over_alone_median": summary}
    print(json.dumps(out, indent=2) if args.json else
          "medians: " + ", ".join(f"{k} {v}x" for k, v in summary.items()))


if __name__ == "__main__":
    main()
