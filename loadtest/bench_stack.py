"""The whole stack by batch size: output tok/s and TPOT at batch 16 / 64 / 128 / 256, paged
KV against --contiguous in the same KV memory, and the stack against the in-process engine.

    python loadtest/bench_stack.py --model FOLDER --device cuda --dtype bfloat16 --json
    python loadtest/bench_stack.py --device cpu --batches 2,4 --output-tokens 8 \
        --max-model-len 128 --kv-tokens 512          # a dry run on the CPU

At each batch B, B streaming completions (prompts of --prompt-len random token ids, greedy,
exactly --output-tokens each) are sent at once, and output tok/s = B x output tokens / wall
time; TPOT is per request, (last token - first token) / (output tokens - 1), p50.

  paged       `pagedserve serve` (Redis, gateway, scheduler, executor), paged KV blocks
  async       paged with --async-scheduling on: while only steady decodes run, each step
              is planned and sent while the one before runs (services/scheduler/ahead.py);
              paged has the default, auto: on with a GPU executor, off with a CPU one
  sync        paged with --async-scheduling off: every step waits for the result of the
              one before
  contiguous  the same stack with --contiguous: every request reserves --max-model-len
              tokens of KV up front, as servers did before PagedAttention
  inprocess   services.engine.OfflineEngine: the scheduler driving the executor in one
              process, no Redis / HTTP / ZeroMQ (what the stack costs is the gap)

All of them get the same KV pool, --kv-tokens (default 16 x --max-model-len): contiguous
reservations fit 16 requests at a time, paged blocks fit the batch the prompts need. One
stack per system serves every batch (--max-num-seqs = the largest batch).

--pin (a CPU stand-in for an accelerator): the executor runs one thread on core 0 alone,
every other process of the stack and the clients run on the other cores, so the host's
work (scheduler, Redis, gateway) never slows the forward, as with a GPU.

For the stacks, `executor_idle` is the share of the batch's wall time the executor spent
waiting for its next plan (its Health reply counts the seconds it spent on plans), and
`planned_ahead` the share of steps planned while the step before ran (the scheduler's
`pagedserve:steps_planned_ahead_total` over `pagedserve:steps_total`, from /metrics).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from loadtest.docgen import metric  # noqa: E402
from services.launcher import Stack, build_parser, free_port, free_ports  # noqa: E402
from shared.control import ExecutorClient  # noqa: E402
from shared.model_source import resolve_model  # noqa: E402


def prompts_for(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, vocab - 300) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


async def _stream(client, model: str, prompt: list[int], out_tokens: int, t0: float):
    """(first, last) token times of one streamed greedy completion, from t0."""
    body = {"model": model, "prompt": prompt, "max_tokens": out_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    first = last = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                last = time.perf_counter() - t0
                first = last if first is None else first
    return first, last


def figures(wall: float, spans: list[tuple[float, float]], batch: int, out_tokens: int) -> dict:
    tpot = [(last - first) / max(1, out_tokens - 1) for first, last in spans]
    return {"tok_s": batch * out_tokens / wall, "tpot_ms_p50": 1000 * statistics.median(tpot),
            "ttft_ms_p50": 1000 * statistics.median(f for f, _ in spans), "wall_s": wall}


def _steps(url: str) -> tuple[float, float]:
    """(steps planned, of them planned ahead) so far, from the gateway's /metrics."""
    return (metric(url, "pagedserve:steps_total"),
            metric(url, "pagedserve:steps_planned_ahead_total"))


def run_stack(args, prompts: dict[int, list], system: str) -> dict:
    argv = ["serve", "--port", str(free_port()), "--grpc-port", str(free_port()),
            "--zmq-port", str(free_ports(2)), "--model", args.model, "--device", args.device,
            "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
            "--num-gpu-blocks", str(args.kv_tokens // args.block_size),
            "--block-size", str(args.block_size), "--max-num-seqs", str(max(prompts)),
            "--max-num-batched-tokens", str(args.max_batched_tokens), "--log-level", "warning",
            "--max-queue", "100000"]
    if system == "contiguous":
        argv.append("--contiguous")
    elif system in ("async", "sync"):
        argv += ["--async-scheduling", "on" if system == "async" else "off"]
    if args.pin:
        argv += ["--num-threads", "1"]
    out = {}
    with Stack(build_parser().parse_args(argv)) as stack:
        url = stack.start()
        executor = ExecutorClient(stack.args.executor)      # the port the stack chose
        if args.pin:
            _pin(stack)

        async def go(batch_prompts):
            async with httpx.AsyncClient(base_url=url, timeout=1800,
                                         limits=httpx.Limits(max_connections=4096)) as c:
                await _stream(c, args.served, batch_prompts[0], 4, time.perf_counter())
                t0 = time.perf_counter()
                spans = await asyncio.gather(*[_stream(c, args.served, p, args.output_tokens,
                                                       t0) for p in batch_prompts])
                return spans, time.perf_counter() - t0

        for batch, ps in prompts.items():
            time.sleep(0.5)                   # the scheduler's metrics are 0.2 s fresh
            steps0 = _steps(url)
            busy0, t0 = executor.health(timeout=10).busy_s, time.perf_counter()
            spans, wall = asyncio.run(go(ps))
            busy1, t1 = executor.health(timeout=10).busy_s, time.perf_counter()
            time.sleep(0.5)
            steps1 = _steps(url)
            out[batch] = figures(wall, spans, batch, args.output_tokens)
            out[batch]["executor_idle"] = 1 - (busy1 - busy0) / (t1 - t0)
            out[batch]["planned_ahead"] = ((steps1[1] - steps0[1])
                                           / max(1.0, steps1[0] - steps0[0]))
            _say(args, system, batch, out[batch])
    return out


def _pin(stack) -> None:
    """The executor (every thread) on core 0; the rest of the stack and this process on
    the other cores."""
    others = sorted(os.sched_getaffinity(0) - {0})
    if not others:
        raise SystemExit("--pin needs two cores or more")
    rest = ",".join(map(str, others))
    for name, proc in stack.procs:
        subprocess.run(["taskset", "-a", "-cp", "0" if name == "executor" else rest,
                        str(proc.pid)], check=True, capture_output=True)
    os.sched_setaffinity(0, others)


def run_inprocess(args, prompts: dict[int, list]) -> dict:
    from services.engine import OfflineEngine
    from services.executor.config import ExecutorConfig
    from services.scheduler.config import SchedulerConfig
    from shared.messages import SamplingParams

    engine = OfflineEngine(
        ExecutorConfig(model=args.model, device=args.device, dtype=args.dtype,
                       max_model_len=args.max_model_len, block_size=args.block_size,
                       num_gpu_blocks=args.kv_tokens // args.block_size,
                       max_num_batched_tokens=args.max_batched_tokens),
        SchedulerConfig(max_num_seqs=max(prompts), block_size=args.block_size,
                        max_num_batched_tokens=args.max_batched_tokens))
    engine.generate([engine.request(prompts[min(prompts)][0],
                                    SamplingParams(temperature=0, max_tokens=4))])
    out = {}
    for batch, ps in prompts.items():
        reqs = [engine.request(p, SamplingParams(temperature=0, max_tokens=args.output_tokens),
                               ignore_eos=True) for p in ps]
        t0 = time.perf_counter()
        done = engine.generate(reqs)
        wall = time.perf_counter() - t0
        spans = [(c.first_token_s, c.done_s) for c in done.values()]   # from t0
        out[batch] = figures(wall, spans, batch, args.output_tokens)
        _say(args, "inprocess", batch, out[batch])
    return out


def _say(args, system: str, batch: int, f: dict) -> None:
    print(f"{system:10s} batch {batch:4d}: {f['tok_s']:9.1f} output tok/s, TPOT p50 "
          f"{f['tpot_ms_p50']:7.2f} ms, TTFT p50 {f['ttft_ms_p50']:8.1f} ms"
          + (f", executor idle {f['executor_idle']:.1%}, planned ahead "
             f"{f['planned_ahead']:.0%}" if "executor_idle" in f else ""),
          file=sys.stderr if args.json else sys.stdout, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct",
                    help="served name, .gguf or HF folder (loadtest/random_model.py)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="16,64,128,256")
    ap.add_argument("--systems", default="paged,contiguous,inprocess",
                    help="of paged, async, sync, contiguous, inprocess")
    ap.add_argument("--prompt-len", default="64,320", help="LO,HI tokens (uniform)")
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-tokens", type=int, default=None,
                    help="KV pool of every system, tokens (default 16 x --max-model-len)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pin", action="store_true",
                    help="stacks only: the executor alone on core 0 with one thread")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.kv_tokens = args.kv_tokens or 16 * args.max_model_len
    source = resolve_model(args.model)
    args.served = source.served_name
    vocab = json.loads((source.hf_dir / "config.json").read_text())["vocab_size"] \
        if source.hf_dir else 49152
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    prompts = {b: prompts_for(b, lo, hi, vocab, args.seed + b)
               for b in (int(x) for x in args.batches.split(","))}
    res: dict = {"model": args.served, "device": args.device, "dtype": args.dtype,
                 "kv_tokens": args.kv_tokens, "max_model_len": args.max_model_len,
                 "output_tokens": args.output_tokens}
    systems = args.systems.split(",")
    for system in systems:
        res[system] = (run_inprocess(args, prompts) if system == "inprocess"
                       else run_stack(args, prompts, system))
    # paged plans ahead too with a GPU executor (auto): then it is the async side
    ahead = res.get("async")
    if ahead is None and any(f["planned_ahead"] > 0 for f in res.get("paged", {}).values()):
        ahead = res["paged"]
    for batch in prompts:
        if "paged" in res and "contiguous" in res:
            res.setdefault("paged_over_contiguous", {})[batch] = (
                res["paged"][batch]["tok_s"] / res["contiguous"][batch]["tok_s"])
        if ahead and "sync" in res:
            res.setdefault("async_over_sync", {})[batch] = (
                ahead[batch]["tok_s"] / res["sync"][batch]["tok_s"])
        if "paged" in res and "inprocess" in res:
            res.setdefault("stack_over_inprocess", {})[batch] = (
                res["paged"][batch]["tok_s"] / res["inprocess"][batch]["tok_s"])
    for key in ("paged_over_contiguous", "async_over_sync", "stack_over_inprocess"):
        if key in res:
            print(f"{key}: " + ", ".join(f"batch {b} {v:.2f}x" for b, v in res[key].items()),
                  file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
