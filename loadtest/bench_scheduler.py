"""Scheduler overhead per step: median wall time of one schedule() + update() cycle.

N requests (ShareGPT-like prompts, outputs long enough not to finish) are prefilled, then
the benchmark times decode steps with all N sequences running. Building the StepResult (the
executor's job) is outside the timed region; everything the engine core does per step is in
it: choosing the batch, block growth, the plan's diffs, applying sampled tokens, the step's
news (StepOutputs, columnar). Two figures are timed apart, what the scheduler service adds
per step around the core (in --json):

    wire_ms      the executor's wire: encoding the plan, decoding the result (shared/wire.py)
    publish_ms   the outputs' edge: encoding each request's RequestOutput from the step's
                 columns for its output stream (StepOutputs.encoded), then the scheduler
                 service's own per-output work before the XADD (SchedulerService.publish:
                 the request timeline and its latency histograms)

    python loadtest/bench_scheduler.py [--sizes 64,256,1024] [--steps 300] [--repeats 3]
                                       [--gc default|service|both] [--floor] [--json]

Each size is measured --repeats times in fresh schedulers; the best of the per-run medians is
reported, so that other processes on a shared machine inflate the figure as little as possible.

Two garbage-collector settings, both reported (--gc picks one):

    service   what the scheduler service runs with (services/scheduler/service.py:
              start-up state frozen out of the collector, GC_THRESHOLD): the scheduler as
              pagedserve runs it; `step_ms` in --json
    default   the interpreter's defaults (young collections every 700 allocations): what a
              program embedding the Scheduler without tuning gets; `step_ms_default_gc`

Instructions per sequence per step, free of timing noise: run --untimed under Valgrind
twice, with two step counts, and divide the difference (set-up and prefill cancel out; the
stand-in executor's result adds a few instructions per sequence):

    for s in 10 40; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        .venv/bin/python loadtest/bench_scheduler.py --untimed --gc service \
        --sizes 256 --steps $s 2>&1 | grep Collected; done   # (b - a) / 30 / 256

--floor also times, in the same steps (just before each schedule()), a walk over the running
seqs that touches only what any decode of a seq must: its group, the seq, the tail of its
tokens and of its block table, and the pool's count of that block (`floor_walk`). Its ns per
seq at each size is what the heap of per-request objects costs on this CPU whatever the
scheduler does with them (`floor_ms` in --json; docs/overhead.md).

NOTE: they differ most at 1,024 seqs. With the defaults, each step's plan and outputs (a few
objects per seq) outlive two young collections, are promoted to the old generation, and set
off a full collection every ~10 steps that walks every live object; the young collections of
every step also walk more live objects than the cache holds. The service's settings avoid
both; the scheduler's own work is the same in both.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.workloads import SHAREGPT, sample_lengths  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from services.scheduler.metrics import SchedulerMetrics  # noqa: E402
from services.scheduler.scheduler import Scheduler  # noqa: E402
from services.scheduler.service import SchedulerService, SchedulerServiceConfig  # noqa: E402
from shared.messages import GenerationRequest, SamplingParams, StepResult  # noqa: E402
from shared.wire import decode, encode  # noqa: E402


def fake_result(plan, token: int = 7) -> StepResult:
    """What an executor returns: one token per sampling row of the plan."""
    n = plan.num_sampling_rows
    return StepResult(plan.step_id, [token] * n, [-0.5] * n)


def floor_walk(running: list, ref_count: list[int]) -> list[tuple]:
    """What a decode of each running seq reads at the least: its group, the seq, the tail of
    its tokens and of its block table, and the pool's count of that block."""
    # (the seq's own slots, not its properties: a seq in the scheduler's lead keeps these
    # fields in columns, and the walk is about the objects)
    return [(seq.seq_id, c, seq._tokens[c - 1], ref_count[seq.block_table[-1]])
            for seq in (group.seqs[0] for group in running)
            for c in (seq._computed,)]


def bench(num_seqs: int, steps: int, block_size: int = 16, seed: int = 0,
          gc_freeze: bool = False, untimed: bool = False, floor: bool = False) -> dict:
    # A budget that decodes every running seq and still prefills 2,048 tokens per step, so
    # that the first seqs do not outgrow the pool while the last ones are prefilled.
    cfg = SchedulerConfig(block_size=block_size, max_num_seqs=num_seqs,
                          max_num_batched_tokens=num_seqs + 2048, max_model_len=4096)
    lengths = sample_lengths(SHAREGPT, num_seqs, seed, max_len=1024)
    # Room for every seq to grow through the prefill phase and the timed steps: no preemption.
    num_blocks = 2 * sum(-(-(p + steps + 64) // block_size) for p, _ in lengths)
    sched = Scheduler(cfg, num_blocks, 0)
    old_threshold = gc.get_threshold()
    if gc_freeze:
        # As the scheduler service does once it has started (its Scheduler, pool included, is
        # frozen; requests arrive later and are collected as usual).
        from shared.heap import settle_heap
        settle_heap()
    for i, (p, _) in enumerate(lengths):
        prompt = [100 + (i * 31 + j) % 40000 for j in range(p)]
        sched.add_request(GenerationRequest(f"b{i}", prompt,
                                            SamplingParams(max_tokens=4096 - p - 1),
                                            arrival_time=float(i)))
    # Prefill until every sequence decodes.
    while True:
        plan = sched.schedule()
        assert sched.stats().num_preemptions == 0
        if all(n == 1 for n in plan.num_tokens) and len(plan.num_tokens) == num_seqs:
            sched.update(plan, fake_result(plan))
            break
        sched.update(plan, fake_result(plan))
    # The service's publishing half, with no Redis or executor behind it (neither is
    # reached: publish() only queues for the next round).
    service = SchedulerService(SchedulerServiceConfig(core=cfg))
    service.sched = sched
    service.metrics = SchedulerMetrics("bench", sched.stats)
    service.requests = dict(sched.groups)
    gc.collect()
    if untimed:
        for _ in range(steps):
            plan = sched.schedule()
            sched.update(plan, fake_result(plan))
        return {}
    times = []
    wire = []
    publish = []
    walks = []
    ref_count = sched.block_manager.gpu.ref_count
    for _ in range(steps):
        if floor:
            tw = time.perf_counter()
            floor_walk(sched.running, ref_count)
            walks.append(time.perf_counter() - tw)
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        result = encode(fake_result(plan))
        t2 = time.perf_counter()
        encode(plan)
        result = decode(result, StepResult)
        t3 = time.perf_counter()
        outs = sched.update(plan, result)
        t4 = time.perf_counter()
        published = outs.encoded()
        service.publish(published)
        t5 = time.perf_counter()
        service.pending_outputs.clear()
        assert len(plan.seq_ids) == num_seqs and len(published) == num_seqs
        times.append((t1 - t0) + (t4 - t3))
        wire.append(t3 - t2)
        publish.append(t5 - t4)
    if gc_freeze:
        gc.unfreeze()
        gc.set_threshold(*old_threshold)
    return {"median_ms": statistics.median(times) * 1e3,
            "wire_ms": statistics.median(wire) * 1e3,
            "publish_ms": statistics.median(publish) * 1e3,
            "p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3,
            "per_seq_us": statistics.median(times) * 1e6 / num_seqs,
            "floor_ms": statistics.median(walks) * 1e3 if floor else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gc", choices=("default", "service", "both"), default="both",
                    help="garbage-collector settings to measure under (see above)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--floor", action="store_true",
                    help="also time floor_walk: the least a decode of each seq touches")
    ap.add_argument("--untimed", action="store_true",
                    help="only run the decode steps of the first size, once, untimed: for an "
                         "instruction counter (see the module docstring)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    modes = ("service", "default") if args.gc == "both" else (args.gc,)
    if args.untimed:
        bench(sizes[0], args.steps, args.block_size, gc_freeze=modes[0] == "service",
              untimed=True)
        return
    res: dict[str, dict[int, dict]] = {m: {} for m in modes}
    floors: dict[int, float] = {}
    for n in sizes:
        for r in range(args.repeats):      # the modes interleaved: the same machine load
            for m in modes:
                run = bench(n, args.steps, args.block_size, seed=r, gc_freeze=m == "service")
                best = res[m].get(n)
                if best is None or run["median_ms"] < best["median_ms"]:
                    res[m][n] = run
            if args.floor:                 # apart: the walk warms the seqs for schedule()
                walk = bench(n, args.steps, args.block_size, seed=r,
                             gc_freeze=modes[0] == "service", floor=True)["floor_ms"]
                floors[n] = min(floors.get(n, walk), walk)
    if args.json:
        key = {"service": "step_ms", "default": "step_ms_default_gc"}
        out = {key[m]: {str(n): round(r["median_ms"], 4) for n, r in res[m].items()}
               for m in modes}
        for k in ("wire_ms", "publish_ms"):
            out[k] = {str(n): round(r[k], 4) for n, r in res[modes[0]].items()}
        if floors:
            out["floor_ms"] = {str(n): round(ms, 4) for n, ms in floors.items()}
        print(json.dumps(out))
        return
    print(f"{'gc':>8} {'running seqs':>12} {'median ms':>10} {'p90 ms':>8} {'us/seq':>7}")
    for m in modes:
        for n, r in res[m].items():
            print(f"{m:>8} {n:>12} {r['median_ms']:>10.3f} {r['p90_ms']:>8.3f} "
                  f"{r['per_seq_us']:>7.2f}")
    for n, ms in floors.items():
        print(f"{'floor':>8} {n:>12} {ms:>10.3f} {'':>8} {ms * 1e3 / n:>7.2f}")


if __name__ == "__main__":
    main()
