"""The CPU decode attention kernel alone, reading an fp32 KV cache and a bf16 one, in turns
in the same run: ms per decode step over every layer, the bytes read per second, and the
ratio bf16 / fp32 (what `--kv-cache-dtype bfloat16` saves an fp32 model's decode step).

    python loadtest/bench_decode_attention.py                  # SmolLM2-135M's shape
    python loadtest/bench_decode_attention.py --batch 64 --context 200 --rounds 3 --json
    python loadtest/bench_decode_attention.py --baseline HEAD  # against HEAD's kernel
    python loadtest/bench_decode_attention.py --heads-at-once 4,1   # V's heads together / alone

--baseline REV builds the kernel source of git revision REV (services/executor/
cpu_kernels.c, with cpu_kernels.py's flags) beside the current one and times both on the
same pools, alternating which goes first, and reports the median of each with the ratio.
--heads-at-once N,M times the current kernel with each limit on the query heads of a KV
head its weighted sum of V takes at once (what the executor picks per CPU at its first
start, `attention.pick_decode_heads`), in turns; the first is the one against the baseline.

Each layer has its own pool with the blocks of every sequence in shuffled order, as a
pool looks after some serving; the query is random (the kernel's cost does not depend on
the values).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from services.launcher import executor_openmp_defaults  # noqa: E402

executor_openmp_defaults()       # as `serve` runs the executor: before torch loads OpenMP
import torch  # noqa: E402

from loadtest.kernel_revision import build_kernels  # noqa: E402
from services.executor import cpu_kernels  # noqa: E402


def make_inputs(dtype: torch.dtype, args):
    g = torch.Generator().manual_seed(0)
    per_seq = -(-args.context // args.block_size)
    nblocks = args.batch * per_seq
    pools = [tuple(torch.randn(nblocks, args.block_size, args.kv_heads, args.head_dim,
                               generator=g).to(dtype) for _ in range(2))
             for _ in range(args.layers)]
    tables = torch.randperm(nblocks, generator=g).view(args.batch, per_seq).to(torch.int32)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=g)
    return pools, tables, lens, q


def step_ms(lib: ctypes.CDLL, inputs, args, reps: int, baseline: bool = False,
            heads_at_once: int = cpu_kernels.HEADS_AT_ONCE) -> float:
    """ms per decode step of `lib`'s kernel (decode_attention reads the module's library,
    swapped in for the measurement). A baseline gets the query multiplied by the scale in
    torch and a scale of 1: the kernels of revisions before the scale was an argument
    expect it so (and ignore the scale and row-stride arguments they do not declare)."""
    pools, tables, lens, q = inputs
    scale = args.head_dim ** -0.5

    def step():
        for k, v in pools:
            if baseline:
                cpu_kernels.decode_attention(q * scale, k, v, tables, lens, args.context, 1.0)
            else:
                cpu_kernels.decode_attention(q, k, v, tables, lens, args.context, scale,
                                             heads_at_once=heads_at_once)

    saved, cpu_kernels._lib = cpu_kernels._lib, lib
    try:
        step()                               # warm-up: page in the pools
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        return (time.perf_counter() - t0) / reps * 1e3
    finally:
        cpu_kernels._lib = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=200, help="tokens per sequence")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5, help="steps timed per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="fp32, bf16 measurements in turn")
    ap.add_argument("--baseline", metavar="REV",
                    help="also time the kernel of git revision REV, alternating with this one")
    ap.add_argument("--heads-at-once", default=str(cpu_kernels.HEADS_AT_ONCE), metavar="N[,M..]",
                    help="query heads of a KV head the weighted sum of V takes at once, at "
                         f"most (default {cpu_kernels.HEADS_AT_ONCE}); several: each in turn")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        groups = [int(x) for x in args.heads_at_once.split(",")]
        if not groups or min(groups) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--heads-at-once: positive integers, not {args.heads_at_once!r}")
    lib = cpu_kernels.kernels()
    if lib is None:
        sys.exit("bench_decode_attention: the C kernels are not built here (no C compiler?)")
    with tempfile.TemporaryDirectory() as tmp:
        base = build_kernels(args.baseline, Path(tmp)) if args.baseline else None
        # (library, heads at once; None: the baseline) in the order of a round
        runs = [(lib, n) for n in groups] + ([(base, None)] if base is not None else [])
        times: dict = {run: {"float32": [], "bfloat16": []} for run in runs}
        for r in range(args.rounds):
            for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                inputs = make_inputs(dtype, args)
                # which one runs first alternates from round to round
                for run in (runs if r % 2 == 0 else runs[::-1]):
                    which, n = run
                    times[run][name].append(
                        step_ms(which, inputs, args, args.reps, baseline=True) if n is None
                        else step_ms(which, inputs, args, args.reps, heads_at_once=n))
                del inputs
        ms = times[runs[0]]
        base_ms = times[(base, None)] if base is not None else {}
    tokens = args.layers * args.batch * args.context
    row = args.kv_heads * args.head_dim * 2           # K and V elements per token and layer
    out = {"batch": args.batch, "context": args.context, "layers": args.layers,
           "threads": torch.get_num_threads(), "ms_per_step": ms,
           "ms_per_step_median": {k: statistics.median(v) for k, v in ms.items()},
           "gb_per_s": {k: tokens * row * (4 if k == "float32" else 2)
                        / (statistics.median(v) / 1e3) / 1e9 for k, v in ms.items()},
           "omp": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}}
    out["speedup_bf16"] = out["ms_per_step_median"]["float32"] / out["ms_per_step_median"]["bfloat16"]
    out["heads_at_once"] = groups[0]
    if len(groups) > 1:
        # each further limit's median step against the first's (> 1: the first is faster)
        out["by_heads_at_once"] = {
            str(n): {"ms_per_step": times[(lib, n)],
                     "ms_per_step_median": {k: statistics.median(v)
                                            for k, v in times[(lib, n)].items()}}
            for n in groups}
        out["vs_first"] = {str(n): {k: statistics.median(times[(lib, n)][k])
                                    / out["ms_per_step_median"][k] for k in ms}
                           for n in groups[1:]}
    if base is not None:
        med = {k: statistics.median(v) for k, v in base_ms.items()}
        out["baseline"] = {"rev": args.baseline, "ms_per_step": base_ms,
                           "ms_per_step_median": med,
                           "speedup": {k: med[k] / out["ms_per_step_median"][k] for k in med}}
    if args.json:
        print(json.dumps(out))
        return
    for k in ms:
        print(f"{k:9s} cache: " + ", ".join(f"{x:.1f}" for x in ms[k])
              + f" ms per step; {out['gb_per_s'][k]:.1f} GB/s read")
    print(f"bf16 cache / fp32 cache: {out['speedup_bf16']:.2f}x faster")
    for n in groups[1:]:
        for k in ms:
            print(f"{k:9s} cache, {n} heads at once: "
                  + ", ".join(f"{x:.1f}" for x in times[(lib, n)][k])
                  + f" ms per step; against {groups[0]}: {out['vs_first'][str(n)][k]:.2f}x "
                    "the time")
    if base is not None:
        b = out["baseline"]
        for k in ms:
            print(f"{k:9s} cache, {args.baseline}: " + ", ".join(f"{x:.1f}" for x in base_ms[k])
                  + f" ms per step; median {b['ms_per_step_median'][k]:.1f} -> "
                  f"{out['ms_per_step_median'][k]:.1f}: {b['speedup'][k]:.2f}x faster")


if __name__ == "__main__":
    main()
