"""Where one executor step spends its time: decode steps at a fixed batch, profiled.

Prints the step time, then cProfile's top functions (Python-side cost: plan handling,
metadata, kernel launches) and torch.profiler's top operators by host time and by device
time. On a GPU the difference between the step time and the summed device time is
host overhead that the GPU waits on.

    .venv/bin/python loadtest/profile_step.py --batch 32
    python loadtest/profile_step.py --device cuda --model FOLDER --dtype bfloat16 --batch 1
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.bench_executor import Loop, workload  # noqa: E402
from services.executor.config import ExecutorConfig  # noqa: E402
from services.executor.model_runner import ModelRunner  # noqa: E402
from shared.messages import StepPlan  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20, help="decode steps profiled")
    ap.add_argument("--rows", type=int, default=25, help="rows per table")
    ap.add_argument("--cuda-graph-max-batch", type=int, default=256,
                    help="GPU decode steps of up to this many seqs replay CUDA graphs (0: off)")
    args = ap.parse_args()
    model = {"model": args.model} if args.model else {}
    runner = ModelRunner(ExecutorConfig(dtype=args.dtype, device=args.device, kv_cache_gib=1.0,
                                        swap_space_gib=0.0, gpu_memory_utilization=0.5,
                                        cuda_graph_max_batch=args.cuda_graph_max_batch,
                                        **model))
    prompts = workload(args.batch, args.prompt_len, args.prompt_len, runner.args.vocab_size)
    loop = Loop(runner, budget=max(2048, args.prompt_len))
    loop.run(prompts[:2], 4)                                     # compile and warm up
    prefill_steps = -(-args.batch * args.prompt_len // loop.budget)
    total = prefill_steps + 2 * args.steps + 4

    prof = cProfile.Profile()
    times: list[float] = []
    state = {"t": 0.0, "on": False}

    def on_step(plan: StepPlan) -> None:
        # profile `steps` whole-batch decode steps after `steps` warm ones
        decoding = (len(plan.num_tokens) == args.batch
                    and all(n == 1 for n in plan.num_tokens))
        if state["on"]:
            times.append(time.perf_counter() - state["t"])
            if len(times) == args.steps:
                prof.disable()
                torch_prof.__exit__(None, None, None)
                state["on"] = False
                state["done"] = True
        elif decoding and not state.get("done") and plan.step_id >= loop_start + args.steps:
            torch_prof.__enter__()
            prof.enable()
            state["on"] = True
        state["t"] = time.perf_counter()

    acts = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    torch_prof = torch.profiler.profile(activities=acts)
    loop_start = loop.step
    loop.run(prompts, total, on_step=on_step)
    if not times:
        sys.exit("no whole-batch decode steps were profiled: raise --steps")
    step_ms = 1e3 * sum(times) / len(times)
    graphs = "" if args.device != "cuda" else f", graphs up to {args.cuda_graph_max_batch}"
    print(f"{args.device} {args.dtype} batch {args.batch}{graphs}: {step_ms:.2f} ms per "
          f"decode step ({args.batch / step_ms * 1e3:.0f} tok/s) over {len(times)} profiled steps "
          "(profilers on: slower than unprofiled)")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.rows)
    print(out.getvalue())
    events = torch_prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if args.device == "cuda":
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
