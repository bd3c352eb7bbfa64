"""Executor benchmark: ModelRunner against transformers `generate`, on the CPU path by default.

    .venv/bin/python loadtest/bench_executor.py            # full run, a table
    .venv/bin/python loadtest/bench_executor.py --json     # the figures as one JSON object
    .venv/bin/python loadtest/bench_executor.py --quick    # fewer sizes, a smoke run
    python loadtest/bench_executor.py --device cuda --model FOLDER --requests 256 \
        --batches 1,8,32,64,128,256 --hf-batches 64,128,256   # on a GPU (no roofline)

Per dtype (fp32, bf16), with the bundled SmolLM2-135M-Instruct:
  * decode throughput at batch 1, 8, 32, 64, 128: tokens/s while every seq decodes;
  * end to end on a fixed workload: 64 requests, prompts of 32-256 tokens, exactly 128
    output tokens each, through a simple continuous-batching loop over ModelRunner
    (every step: decodes first, then prefill chunks up to the token budget);
  * the same prompts through transformers `generate` at its best static batch size;
and once, the machine's fp32 matmul rate (a big sgemm, the fastest of torch's BLAS and the
packed GEMMs the engine can pick), which gives the roofline
FLOP/s / (2 x params) tokens/s, counting every processed token (prompt and output).
The CPUs may be shared with other work: compare ratios, and rerun when in doubt.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from collections import deque
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.executor.cpu_gemm import packed_gemm, usable_gemms  # noqa: E402
from services.executor.config import ExecutorConfig  # noqa: E402
from services.executor.model_runner import ModelRunner  # noqa: E402
from shared.messages import NewSeq, SamplingParams, StepPlan  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
# The clock of every measurement. `--clock cpu` (with --threads 1) counts only the CPU time
# this process got: on a machine shared with other work it estimates the idle-machine
# figures, which wall time cannot.
now = time.perf_counter


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


class Loop:
    """The smallest continuous-batching driver: a free list of blocks and a token budget."""

    def __init__(self, runner: ModelRunner, budget: int) -> None:
        self.r = runner
        self.budget = budget
        self.free = deque(range(runner.num_gpu_blocks))
        self.step = 0
        self.processed = 0

    def run(self, prompts: list[list[int]], new_tokens: int, on_step=None) -> int:
        """Generate `new_tokens` per prompt; returns the number of steps. `self.processed`
        counts the tokens the forward passes took in (prompts and fed-back outputs)."""
        bs = self.r.block_size
        waiting = deque(range(len(prompts)))
        tokens = {i: list(p) for i, p in enumerate(prompts)}
        computed = {i: 0 for i in range(len(prompts))}
        tables: dict[int, list[int]] = {}
        pending: dict[int, list[int]] = {}
        running: list[int] = []
        finished: list[int] = []
        steps = 0
        while waiting or running:
            plan = StepPlan(self.step, finished_seq_ids=finished)
            finished = []
            left = self.budget
            for sid in running:        # decodes first
                grow = self._grow(tables[sid], computed[sid] + 1, bs)
                _add_row(plan, sid, computed[sid], 1, pending.pop(sid, []), grow)
                computed[sid] += 1
                left -= 1
            partial = False
            while waiting and left > 0:
                sid = waiting[0]
                n = min(len(tokens[sid]) - computed[sid], left)
                need = -(-(computed[sid] + n) // bs) - len(tables.get(sid, []))
                if need > len(self.free):
                    break
                left -= n
                if sid not in tables:
                    tables[sid] = []
                    grow = self._grow(tables[sid], n, bs)
                    plan.new_seqs.append(NewSeq(sid, str(sid), tokens[sid], len(tokens[sid]),
                                                grow, GREEDY))
                    _add_row(plan, sid, 0, n, [], [])
                else:
                    grow = self._grow(tables[sid], computed[sid] + n, bs)
                    _add_row(plan, sid, computed[sid], n, [], grow)
                computed[sid] += n
                if computed[sid] == len(tokens[sid]):
                    waiting.popleft()
                    running.append(sid)
                else:
                    partial = True      # the budget ran out inside this prompt: its row is last
            plan.num_sampling_rows = len(plan.seq_ids) - partial
            res = self.r.execute(plan)
            self.processed += sum(plan.num_tokens)
            if res.error:
                raise RuntimeError(res.error)
            self.step += 1
            steps += 1
            if on_step:
                on_step(plan)
            for sid, token in zip(plan.seq_ids, res.token_ids):     # row r's token
                tokens[sid].append(token)
                pending.setdefault(sid, []).append(token)
                if len(tokens[sid]) - len(prompts[sid]) >= new_tokens:
                    running.remove(sid)
                    finished.append(sid)
                    self.free.extend(tables.pop(sid))
        self.r.execute(StepPlan(self.step, finished_seq_ids=finished))
        self.step += 1
        return steps

    def _grow(self, table: list[int], num_tokens: int, bs: int) -> list[int]:
        grow = [self.free.popleft() for _ in range(-(-num_tokens // bs) - len(table))]
        table += grow
        return grow


def _add_row(plan: StepPlan, seq_id: int, computed: int, num_tokens: int, append: list[int],
             blocks: list[int]) -> None:
    plan.seq_ids.append(seq_id)
    plan.num_computed_tokens.append(computed)
    plan.num_tokens.append(num_tokens)
    plan.num_append_tokens.append(len(append))
    plan.append_token_ids += append
    plan.block_keep.append(-1)
    plan.block_append.append(blocks)


def bench_decode(runner: ModelRunner, batch: int, prompt_len: int, steps: int) -> float:
    """Tokens/s of `steps` decode steps with `batch` seqs all decoding."""
    prompts = workload(batch, prompt_len, prompt_len, runner.args.vocab_size, seed=batch)
    loop = Loop(runner, budget=max(2048, prompt_len))
    marks: list[float] = []

    def on_step(plan: StepPlan) -> None:
        if all(n == 1 for n in plan.num_tokens) and len(plan.num_tokens) == batch:
            marks.append(now())

    # The first prompts start decoding while the last are still in prefill: generate long
    # enough that `steps` + 2 steps find the whole batch decoding.
    prefill_steps = -(-batch * prompt_len // loop.budget)
    loop.run(prompts, new_tokens=steps + 2 + prefill_steps, on_step=on_step)
    # marks[i] is the end of decode step i; time steps 1.. to skip the first one
    return batch * (len(marks) - 1) / (marks[-1] - marks[0])


def bench_engine(runner: ModelRunner, prompts: list[list[int]], new_tokens: int,
                 budget: int) -> tuple[float, int]:
    """(seconds, processed tokens) of the whole workload through the continuous-batching
    loop. Processed: every prompt token and every output token fed back, which is all but
    the last output of each request."""
    loop = Loop(runner, budget)
    t0 = now()
    loop.run(prompts, new_tokens)
    return now() - t0, loop.processed


def bench_hf(folder: Path, dtype: torch.dtype, prompts: list[list[int]], new_tokens: int,
             batch: int, pad: int, device: str = "cpu") -> float:
    """Seconds for transformers `generate` over the prompts in static batches (arrival order,
    left padded), exactly `new_tokens` greedy tokens each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval().to(device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = pad
    t0 = now()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        width = max(map(len, group))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group],
                            device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 do_sample=False)
        assert out.shape[1] == width + new_tokens
    if device == "cuda":
        torch.cuda.synchronize()
    return now() - t0


def sgemm_flops(n: int = 4096, reps: int = 5) -> dict[str, float]:
    """FLOP/s of one n x n x n fp32 product by torch's BLAS (`a @ b`: MKL) and by each
    packed fp32 GEMM the engine can pick here (cpu_gemm.FP32_GEMMS: its own AVX-512 kernel,
    MKL's packed sgemm, oneDNN). The roofline takes the fastest: which one wins depends on
    the CPU (MKL is slower on AMD)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    runs = {"blas": lambda: a @ b}
    for gemm in usable_gemms():
        run = packed_gemm(gemm, b)[1]
        runs[gemm] = lambda run=run: run(a)
    out = {}
    for name, run in runs.items():
        run()
        best = float("inf")
        for _ in range(reps):
            t0 = now()
            run()
            best = min(best, now() - t0)
        out[name] = 2 * n ** 3 / best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer sizes and requests")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--budget", type=int, default=2048, help="tokens per step")
    ap.add_argument("--hf-batches", default="16,32,64")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the GPU path (no roofline, which is a CPU figure)")
    ap.add_argument("--cuda-graph-max-batch", type=int, default=256,
                    help="GPU: decode steps of up to this many seqs replay CUDA graphs (0: "
                         "eager, the baseline)")
    ap.add_argument("--model", default=None,
                    help="served name, .gguf or HF folder (default: the bundled SmolLM2)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="the KV cache's dtype (auto: each model dtype's own; bfloat16 halves "
                    "an fp32 model's)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: process CPU time, meaningful with --threads 1 on a busy machine")
    args = ap.parse_args()
    global now
    if args.clock == "cpu":
        if args.threads != 1:
            ap.error("--clock cpu needs --threads 1 (CPU time of several threads counts spinning)")
        now = time.process_time
    if args.quick:
        args.batches, args.requests, args.output_len, args.hf_batches = "1,32", 16, 32, "16"
    if args.threads:
        torch.set_num_threads(args.threads)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    dtypes = args.dtypes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    res: dict = {"engine_tok_s": {}, "decode_tok_s": {}, "hf_best_tok_s": {}, "ratio_vs_hf": {},
                 "hf_tok_s": {}, "processed_tok_s": {}, "threads": torch.get_num_threads(),
                 "clock": args.clock, "kv_cache_dtype": args.kv_cache_dtype}
    res["loadavg_start"] = os.getloadavg()[0]   # other work on the CPUs skews every figure
    res["device"] = args.device
    cpu = args.device == "cpu"
    if cpu:
        by_lib = sgemm_flops()
        flops = max(by_lib.values())
        res["sgemm_gflops"] = flops / 1e9
        res["sgemm_gflops_by_library"] = {k: round(v / 1e9, 1) for k, v in by_lib.items()}
        say(f"fp32 GEMM 4096^3: {flops / 1e9:.0f} GFLOP/s on {torch.get_num_threads()} "
            "threads (" + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in by_lib.items()) + ")")
    else:
        res["gpu"] = torch.cuda.get_device_name()
        res["cuda_graph_max_batch"] = args.cuda_graph_max_batch
    model = {"model": args.model} if args.model else {}
    for dt in dtypes:
        # the flag is for an fp32 model; a 16-bit model keeps its own 16-bit cache
        kv = args.kv_cache_dtype if dt == "float32" else "auto"
        runner = ModelRunner(ExecutorConfig(dtype=dt, device=args.device, kv_cache_gib=2.5,
                                            kv_cache_dtype=kv, swap_space_gib=0.0,
                                            max_num_batched_tokens=args.budget,
                                            cuda_graph_max_batch=args.cuda_graph_max_batch,
                                            **model))
        if not cpu:
            res.setdefault("num_gpu_blocks", {})[dt] = runner.num_gpu_blocks
        prompts = workload(args.requests, 32, 256, runner.args.vocab_size)
        n_prompt = sum(map(len, prompts))
        n_out = args.requests * args.output_len
        bench_engine(runner, prompts[:4], 4, args.budget)   # warm-up
        res["decode_tok_s"][dt] = {}
        for b in batches:
            tps = bench_decode(runner, b, 128, args.decode_steps)
            res["decode_tok_s"][dt][b] = tps
            say(f"{dt:9s} decode batch {b:4d}: {tps:8.1f} tok/s")
        secs, processed = bench_engine(runner, prompts, args.output_len, args.budget)
        res["engine_tok_s"][dt] = n_out / secs
        res["processed_tok_s"][dt] = processed / secs
        say(f"{dt:9s} engine end to end: {n_out / secs:8.1f} output tok/s "
            f"({processed / secs:.1f} processed tok/s, {secs:.1f} s)")
        if dt == "float32" and cpu:
            params = runner.args.num_params
            roofline = flops / (2 * params)
            res["roofline_tok_s"] = roofline
            res["params"] = params
            res["roofline_frac"] = processed / secs / roofline
            say(f"roofline {roofline:.0f} tok/s ({params / 1e6:.1f} M params): engine reaches "
                f"{res['roofline_frac']:.2f}")
        folder = runner.model_dir
        pad = runner.eos_token_id or 0
        del runner
        if not cpu:
            gc.collect()
            torch.cuda.empty_cache()
        if args.no_hf:
            continue
        res["hf_tok_s"][dt] = {}
        for b in (int(x) for x in args.hf_batches.split(",")):
            secs = bench_hf(folder, getattr(torch, dt), prompts, args.output_len, b, pad,
                            args.device)
            res["hf_tok_s"][dt][b] = n_out / secs
            say(f"{dt:9s} transformers generate, static batch {b:3d}: {n_out / secs:8.1f} "
                f"output tok/s ({(n_prompt + n_out - args.requests) / secs:.1f} processed)")
        res["hf_best_tok_s"][dt] = max(res["hf_tok_s"][dt].values())
        res["ratio_vs_hf"][dt] = res["engine_tok_s"][dt] / res["hf_best_tok_s"][dt]
        say(f"{dt:9s} engine / best transformers: {res['ratio_vs_hf'][dt]:.2f}x")
        if dt == "float32" and cpu:
            # the same useful tokens as the engine's (padding not counted)
            res["hf_roofline_frac"] = (res["hf_best_tok_s"][dt]
                                       * (n_prompt + n_out - args.requests) / n_out
                                       / res["roofline_tok_s"])
    res["loadavg_end"] = os.getloadavg()[0]
    say(f"load average (1 min) at start {res['loadavg_start']:.2f}, "
        f"at end {res['loadavg_end']:.2f}")
    if args.json:
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
