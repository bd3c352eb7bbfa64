"""What the microservice stack costs over the in-process engine, measured in one run.

The same workload (same prompt token ids, greedy, fixed output length) runs twice:

  in-process  services.engine.OfflineEngine: the Scheduler driving a ModelRunner directly
  stack       gateway → Redis → scheduler → ZeroMQ → executor, as `pagedserve serve` starts
              it, driven by concurrent HTTP/SSE streaming clients

and the figures are compared side by side: throughput ratio, and the added per-token and
time-to-first-token latency (p50 over requests).

    python loadtest/bench_overhead.py [--requests 48] [--output-tokens 64] [--rounds 3] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.launcher import (Stack, build_parser, executor_openmp_defaults,  # noqa: E402
                               free_port, free_ports)

# Both runs get the executor's OpenMP settings (before torch loads OpenMP): the comparison
# is of what the stack adds around the same forward (OMP_WAIT_POLICY / GOMP_SPINCOUNT in
# the environment override them for both runs; docs/overhead.md).
executor_openmp_defaults()

from loadtest import docgen  # noqa: E402
from loadtest.sse_client import stream_completion  # noqa: E402
from loadtest.workloads import random_prompts as workload  # noqa: E402
from services.engine import OfflineEngine  # noqa: E402
from services.executor.config import ExecutorConfig  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from shared.messages import SamplingParams  # noqa: E402


def run_inprocess(prompts, out_tokens, args) -> dict:
    kv_dtype = getattr(args, "kv_cache_dtype", "auto")
    engine = OfflineEngine(ExecutorConfig(device="cpu", dtype=args.dtype, kv_cache_gib=args.kv_gib,
                                          kv_cache_dtype=kv_dtype),
                           SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                           max_num_batched_tokens=args.max_batched_tokens))
    # warm-up (first forward pays one-off allocation costs)
    engine.generate([engine.request(prompts[0], SamplingParams(temperature=0, max_tokens=4))])
    reqs = [engine.request(p, SamplingParams(temperature=0, max_tokens=out_tokens),
                           ignore_eos=True) for p in prompts]
    t0 = time.perf_counter()
    done = engine.generate(reqs)
    wall = time.perf_counter() - t0
    ttft = [c.first_token_s for c in done.values()]
    tpot = [(c.done_s - c.first_token_s) / (out_tokens - 1) for c in done.values()]
    tokens = sum(len(c.token_ids[0]) for c in done.values())
    return {"wall_s": wall, "tok_s": tokens / wall, "ttft": ttft, "tpot": tpot, "tokens": tokens}


async def _one(port: int, prompt, out_tokens, t0):
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": out_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    _rid, arrivals = await stream_completion("127.0.0.1", port, body)
    if not arrivals:
        return None, None, 0
    return arrivals[0][0] - t0, arrivals[-1][0] - t0, sum(n for _t, n in arrivals)


def run_stack(prompts, out_tokens, args) -> dict:
    port = free_port()
    sargs = build_parser().parse_args([
        "serve", "--port", str(port), "--grpc-port", str(free_port()),
        "--zmq-port", str(free_ports(2)), "--device", "cpu", "--dtype", args.dtype,
        "--kv-cache-dtype", getattr(args, "kv_cache_dtype", "auto"),
        "--kv-cache-gib", str(args.kv_gib), "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_batched_tokens), "--log-level", "warning",
        "--max-queue", "100000"])
    # the with block stops the stack on leaving, also on SIGTERM / SIGINT
    with Stack(sargs) as stack:
        stack.start()

        async def go():
            # lean raw-socket clients (loadtest/sse_client.py): on a small machine an
            # HTTP library's per-event CPU would be taken from the stack it measures
            await _one(port, prompts[0], 4, time.time())    # warm-up
            t0 = time.time()
            res = await asyncio.gather(*[_one(port, p, out_tokens, t0) for p in prompts])
            return res, time.time() - t0

        res, wall = asyncio.run(go())
    # A streamed chunk can carry several tokens (an event per read of the stream); per-token
    # time is measured per request from the first to the last token it received.
    ttft = [f for f, _, _ in res]
    tpot = [(l - f) / (out_tokens - 1) for f, l, _ in res]
    tokens = len(prompts) * out_tokens
    return {"wall_s": wall, "tok_s": tokens / wall, "ttft": ttft, "tpot": tpot, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="pagedserve's --kv-cache-dtype (auto: the model's dtype)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="in-process and stack runs in turn, this many pairs (the order "
                    "swaps each round); the figures are the medians over the rounds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    prompts = workload(args.requests, args.seed)
    p50 = statistics.median
    rounds = []
    for r in range(args.rounds):
        # every other round the stack goes first: drift in the machine's speed (a VM's
        # neighbours) then weighs on both sides alike
        if r % 2 == 0:
            inproc = run_inprocess(prompts, args.output_tokens, args)
            stack = run_stack(prompts, args.output_tokens, args)
        else:
            stack = run_stack(prompts, args.output_tokens, args)
            inproc = run_inprocess(prompts, args.output_tokens, args)
        rounds.append({
            "stack_over_inprocess": stack["tok_s"] / inproc["tok_s"],
            "added_ms_per_token_p50": 1000 * (p50(stack["tpot"]) - p50(inproc["tpot"])),
            "added_ttft_ms_p50": 1000 * (p50(stack["ttft"]) - p50(inproc["ttft"])),
            "inprocess_tok_s": inproc["tok_s"], "stack_tok_s": stack["tok_s"],
            "inprocess_tpot_ms_p50": 1000 * p50(inproc["tpot"]),
            "stack_tpot_ms_p50": 1000 * p50(stack["tpot"]),
            "inprocess_ttft_ms_p50": 1000 * p50(inproc["ttft"]),
            "stack_ttft_ms_p50": 1000 * p50(stack["ttft"]),
        })
    # one round: its figures; several: the median of each figure over the rounds
    out = {k: p50(r[k] for r in rounds) for k in rounds[0]}
    out.update({
        "requests": args.requests, "output_tokens": args.output_tokens, "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "omp_spin_count": os.environ.get("GOMP_SPINCOUNT"), "cpu_model": docgen.cpu(),
        "loadavg_1m": os.getloadavg()[0], "rounds": rounds,
    })
    if args.json:
        print(json.dumps(out))
        return
    for i, r in enumerate(rounds):
        if len(rounds) > 1:
            print(f"round {i + 1}: in-process {r['inprocess_tok_s']:.1f} tok/s, stack "
                  f"{r['stack_tok_s']:.1f}: {r['stack_over_inprocess']:.3f}, "
                  f"{r['added_ms_per_token_p50']:+.2f} ms per token")
    print(("medians of the rounds:\n" if len(rounds) > 1 else "")
          + f"{'':24}{'in-process':>12}{'stack':>12}")
    print(f"{'output tok/s':24}{out['inprocess_tok_s']:12.1f}{out['stack_tok_s']:12.1f}")
    print(f"{'TPOT p50 (ms)':24}{out['inprocess_tpot_ms_p50']:12.2f}{out['stack_tpot_ms_p50']:12.2f}")
    print(f"{'TTFT p50 (ms)':24}{out['inprocess_ttft_ms_p50']:12.1f}{out['stack_ttft_ms_p50']:12.1f}")
    print(f"stack / in-process throughput: {out['stack_over_inprocess']:.3f}")
    print(f"added per token (p50): {out['added_ms_per_token_p50']:.2f} ms; "
          f"added TTFT (p50): {out['added_ttft_ms_p50']:.1f} ms")


if __name__ == "__main__":
    main()
