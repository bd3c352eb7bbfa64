"""Tensor parallelism: what each rank holds and how fast the stack runs, TP=1 vs TP=N.

Two parts, printed side by side:

  measured   `pagedserve serve --tensor-parallel-size N` for each N, on this machine's
             device, driven by the same streaming requests (greedy, fixed output length):
             output tokens/s, the memory of each rank (resident memory on the CPU, device
             memory on a GPU) and the KV pool capacity the scheduler gets (min over ranks).
  estimated  for Llama-3-8B and Llama-3-70B shapes in bf16: weights and KV bytes per token
             per GPU, the KV tokens that fit in one GPU's memory, and the all-reduce traffic
             per decoded token, at TP = 1, 2, 4, 8 (arithmetic, no device needed).

    python loadtest/bench_tp.py [--tp 1,3] [--device cpu|cuda] [--requests 16]
                                [--output-tokens 32] [--json] [--write-docs]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from loadtest.bench_overhead import _one, workload  # noqa: E402
from loadtest.docgen import commit, machine, write_block  # noqa: E402
from services.launcher import Stack, build_parser, free_port  # noqa: E402
from shared.control import ExecutorClient  # noqa: E402

GIB = 1 << 30

# name: (layers, hidden, heads, kv heads, head dim, intermediate, vocab, tied)
SHAPES = {"Llama-3-8B": (32, 4096, 32, 8, 128, 14336, 128256, False),
          "Llama-3-70B": (80, 8192, 64, 8, 128, 28672, 128256, False)}


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _gpu_bytes(pids: list[int]) -> dict[int, int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    used = {}
    for line in out.stdout.splitlines():
        pid, mib = (x.strip() for x in line.split(","))
        used[int(pid)] = int(mib) << 20
    return {p: used.get(p, 0) for p in pids}


def run_tp(tp: int, prompts, args) -> dict:
    # serve picks free ports for the executor's gRPC, ZeroMQ and rendezvous
    flags = ["serve", "--port", str(free_port()), "--tensor-parallel-size", str(tp),
             "--device", args.device, "--dtype", args.dtype,
             "--max-num-seqs", str(args.requests), "--log-level", "warning",
             "--max-queue", "100000"]
    if args.device == "cpu":
        flags += ["--kv-cache-gib", str(args.kv_gib), "--swap-space-gib", "0.0625"]
    with Stack(build_parser().parse_args(flags)) as stack:
        stack.start()
        info = ExecutorClient(f"127.0.0.1:{stack.args.grpc_port}").describe()

        port = stack.args.port

        async def go():
            # the lean raw-socket clients of bench_overhead (loadtest/sse_client.py)
            await _one(port, prompts[0], 4, time.time())    # warm-up
            t0 = time.time()
            res = await asyncio.gather(*[_one(port, p, args.output_tokens, t0)
                                         for p in prompts])
            return res, time.time() - t0

        res, wall = asyncio.run(go())
        parent = next(p.pid for name, p in stack.procs if name == "executor")
        pids = [parent] + _children(parent)       # rank 0, then the ranks it started
        mem = (_gpu_bytes(pids) if args.device == "cuda" else
               {p: _rss_bytes(p) for p in pids})
    # ignore_eos: every request streams exactly output_tokens (_one counts characters)
    assert all(first is not None for first, _, _ in res), "a request streamed nothing"
    tokens = len(prompts) * args.output_tokens
    return {"tp": tp, "out_tok_s": tokens / wall, "wall_s": wall,
            "rank_mem_gib": [mem[p] / GIB for p in pids],
            "kv_blocks": int(info.num_gpu_blocks), "block_size": int(info.block_size),
            "kv_tokens": int(info.num_gpu_blocks) * int(info.block_size)}


# Assumed H200 figures for the estimate: HBM bandwidth, NVLink all-reduce bus bandwidth and
# the fixed cost of one small all-reduce (NCCL, one node).
HBM_BPS, NVLINK_BPS, ALLREDUCE_S = 4.8e12, 360e9, 15e-6


def estimate(gpu_gib: float, util: float = 0.9, batch: int = 64, context: int = 1024) -> list[dict]:
    """Per-GPU memory and decode step time of the Llama 3 shapes in bf16 (2 bytes/element).

    A decode step at `batch` sequences of `context` tokens reads this GPU's weights and its
    share of the batch's KV once from HBM, then adds two all-reduces per layer of [batch, H]
    (a ring moves 2 (tp-1)/tp of the buffer per GPU).
    """
    rows = []
    for name, (L, H, nq, nkv, d, inter, vocab, tied) in SHAPES.items():
        t1 = None
        for tp in (1, 2, 4, 8):
            if nkv % tp or nq % tp:
                continue
            per_layer = (H * (nq + 2 * nkv) * d + nq * d * H + 3 * H * inter) / tp + 2 * H
            embed = vocab * H * (1 if tied else 2)       # replicated: embedding + LM head
            weights = 2 * (L * per_layer + embed + H)
            kv_per_token = 2 * L * 2 * (nkv // tp) * d  # this GPU's K and V heads, bf16
            free = gpu_gib * GIB * util - weights
            ar_bytes = 0 if tp == 1 else 2 * L * batch * H * 2 * 2 * (tp - 1) / tp
            step = ((weights + batch * context * kv_per_token) / HBM_BPS
                    + (0 if tp == 1 else 2 * L * ALLREDUCE_S + ar_bytes / NVLINK_BPS))
            fits = free > batch * context * kv_per_token
            t1 = t1 if t1 is not None or not fits else step
            rows.append({"model": name, "tp": tp, "weights_gib": weights / GIB,
                         "kv_kib_per_token": kv_per_token / 1024,
                         "kv_tokens": max(0, int(free // kv_per_token)),
                         "allreduce_mib_per_step": ar_bytes / (1 << 20),
                         "decode_step_ms": step * 1e3 if fits else None,
                         "speedup_vs_smallest_tp": (t1 / step) if fits and t1 else None})
    return rows


def write_docs(measured: list[dict], est: list[dict], args, path: Path) -> None:
    lines = [
        "<!-- written by loadtest/bench_tp.py --write-docs; edit the script, not this block -->",
        "## Measured", "",
        f"    python loadtest/bench_tp.py --tp {args.tp} --device {args.device} "
        f"--requests {args.requests} --output-tokens {args.output_tokens} --write-docs", "",
        f"SmolLM2-135M-Instruct, {args.dtype}, on {machine(args.device)}, code at commit "
        f"{commit()}; {args.requests} streaming requests of {args.output_tokens} tokens.", "",
        "| TP | output tok/s | vs TP=1 | memory per rank (GiB) | KV pool (tokens) |",
        "|---|---|---|---|---|"]
    base = measured[0]["out_tok_s"]
    for m in measured:
        mem = " / ".join(f"{g:.2f}" for g in m["rank_mem_gib"])
        lines.append(f"| {m['tp']} | {m['out_tok_s']:.1f} | {m['out_tok_s'] / base:.2f} | "
                     f"{mem} | {m['kv_tokens']} |")
    lines += ["", f"## Estimated for a GPU host ({args.gpu_gib:.0f} GiB per GPU, 90 % usable, "
              "bf16)", "",
              f"Assumptions: HBM {HBM_BPS / 1e12:.1f} TB/s, NVLink all-reduce bus bandwidth "
              f"{NVLINK_BPS / 1e9:.0f} GB/s, {ALLREDUCE_S * 1e6:.0f} us per all-reduce; a decode "
              "step at batch 64 with 1,024-token contexts reads this GPU's weights and KV "
              "share once and runs two all-reduces per layer. KV tokens: what the group's "
              "pool holds (every GPU holds its heads of every token).", "",
              "| model | TP | weights per GPU (GiB) | KV per token per GPU (KiB) | "
              "KV tokens of the group | all-reduce per step (MiB) | decode step (ms) | "
              "speed-up vs the smallest TP that fits |", "|---|---|---|---|---|---|---|---|"]
    for e in est:
        step = f"{e['decode_step_ms']:.2f}" if e["decode_step_ms"] else "does not fit"
        sp = f"{e['speedup_vs_smallest_tp']:.2f}x" if e["speedup_vs_smallest_tp"] else "-"
        lines.append(f"| {e['model']} | {e['tp']} | {e['weights_gib']:.1f} | "
                     f"{e['kv_kib_per_token']:.0f} | {e['kv_tokens']:,} | "
                     f"{e['allreduce_mib_per_step']:.0f} | {step} | {sp} |")
    write_block(path, "bench_tp", lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="1,3", help="comma-separated tensor-parallel sizes")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--kv-gib", type=float, default=0.5, help="CPU: KV pool per rank (GiB)")
    ap.add_argument("--gpu-gib", type=float, default=141.0, help="estimate: memory per GPU")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    prompts = workload(args.requests, seed=0)
    measured = [run_tp(int(n), prompts, args) for n in args.tp.split(",")]
    est = estimate(args.gpu_gib)
    if args.write_docs:
        write_docs(measured, est, args, Path(__file__).resolve().parents[1] / "docs/scaling.md")
    if args.json:
        print(json.dumps({"measured": measured, "estimated": est}))
        return
    base = measured[0]["out_tok_s"]
    print(f"{'TP':>3} {'out tok/s':>10} {'vs TP=1':>8} {'KV tokens':>10}  memory per rank (GiB)")
    for m in measured:
        print(f"{m['tp']:>3} {m['out_tok_s']:>10.1f} {m['out_tok_s'] / base:>8.2f} "
              f"{m['kv_tokens']:>10}  " + " / ".join(f"{g:.2f}" for g in m["rank_mem_gib"]))
    for e in est:
        step = f"{e['decode_step_ms']:.2f} ms" if e["decode_step_ms"] else "does not fit"
        print(f"{e['model']:>12} TP={e['tp']}: weights {e['weights_gib']:.1f} GiB/GPU, "
              f"{e['kv_tokens']:,} KV tokens, decode step {step}")


if __name__ == "__main__":
    main()
