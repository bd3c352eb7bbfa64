"""The CPU prefill attention kernel (cpu_kernels.prefill_attention) against what the executor
runs where the kernel declines: torch's SDPA. Both in turns in the same run, on the same
inputs; per chunk shape and dtype the median µs of each and the ratio SDPA / kernel.

    python loadtest/bench_prefill_attention.py                 # SmolLM2-135M's heads
    python loadtest/bench_prefill_attention.py --heads 32 --kv-heads 8 --head-dim 128
    python loadtest/bench_prefill_attention.py --lengths 256,1024 --rounds 7 --json

Two kinds of chunk: "fresh" (a prompt's first chunk, attending to its own K/V: SDPA with
is_causal, torch's flash attention on the CPU) and "continuing" (a chunk of --chunk tokens
at the end of a context of the given length, its earlier keys read from a pool through a
shuffled block table: SDPA over the blocks gathered with index_select and a causal mask,
the executor's fallback).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from services.launcher import executor_openmp_defaults  # noqa: E402

executor_openmp_defaults()       # as `serve` runs the executor: before torch loads OpenMP
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from services.executor import cpu_kernels  # noqa: E402


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def fresh_case(n: int, dtype: torch.dtype, args):
    g = torch.Generator().manual_seed(n)
    q = torch.randn(n, args.heads, args.head_dim, generator=g).to(dtype)
    k = torch.randn(n, args.kv_heads, args.head_dim, generator=g).to(dtype)
    v = torch.randn(n, args.kv_heads, args.head_dim, generator=g).to(dtype)
    out = torch.empty_like(q)
    scale = args.head_dim ** -0.5

    def kernel():
        if not cpu_kernels.prefill_attention(q, k, v, out, scale):
            raise SystemExit("the kernel declined this shape")

    def sdpa():
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=True)
        out.copy_(o[0].transpose(0, 1))

    return kernel, sdpa


def continuing_case(context: int, dtype: torch.dtype, args):
    n = min(args.chunk, context)
    start = context - n
    bs = args.block_size
    nblocks = -(-context // bs)
    g = torch.Generator().manual_seed(context)
    pool_blocks = nblocks * 2
    kc = torch.randn(pool_blocks, bs, args.kv_heads, args.head_dim, generator=g).to(dtype)
    vc = torch.randn(pool_blocks, bs, args.kv_heads, args.head_dim, generator=g).to(dtype)
    table = torch.randperm(pool_blocks, generator=g)[:nblocks].to(torch.int32)
    q = torch.randn(n, args.heads, args.head_dim, generator=g).to(dtype)
    out = torch.empty_like(q)
    scale = args.head_dim ** -0.5
    mask = torch.arange(context)[None, :] <= torch.arange(start, context)[:, None]
    k_flat, v_flat = kc.view(pool_blocks, -1), vc.view(pool_blocks, -1)
    hkv, d = args.kv_heads, args.head_dim

    def kernel():
        if not cpu_kernels.prefill_attention(q, kc, vc, out, scale, table=table, start=start):
            raise SystemExit("the kernel declined this shape")

    def sdpa():
        k = k_flat.index_select(0, table).view(-1, hkv, d)[:context].transpose(0, 1)
        v = v_flat.index_select(0, table).view(-1, hkv, d)[:context].transpose(0, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0),
                                           v.unsqueeze(0), attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        out.copy_(o[0].transpose(0, 1))

    return kernel, sdpa


def time_us(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--lengths", default="144,256,1024",
                    help="fresh chunks' lengths and continuing chunks' context lengths")
    ap.add_argument("--chunk", type=int, default=256,
                    help="a continuing chunk's tokens (the end of its context)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--kinds", default="fresh,continuing")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if cpu_kernels.kernels() is None:
        raise SystemExit("the C kernels did not build on this machine")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    dtypes = [getattr(torch, x) for x in args.dtypes.split(",") if x]
    kinds = [x for x in args.kinds.split(",") if x]
    rows = []
    for kind in kinds:
        for dtype in dtypes:
            for length in lengths:
                if kind == "continuing" and length <= args.chunk:
                    continue
                kernel, sdpa = (fresh_case if kind == "fresh" else continuing_case)(
                    length, dtype, args)
                reps = max(3, int(2e5 / max(length, 1) ** 1.5))
                ks, ss = [], []
                for r in range(args.rounds):       # alternate which goes first
                    pair = [(kernel, ks), (sdpa, ss)]
                    for fn, acc in (pair if r % 2 == 0 else pair[::-1]):
                        acc.append(time_us(fn, reps))
                k_us, s_us = statistics.median(ks), statistics.median(ss)
                rows.append({"kind": kind, "dtype": str(dtype).replace("torch.", ""),
                             "length": length, "kernel_us": round(k_us, 1),
                             "sdpa_us": round(s_us, 1), "sdpa_over_kernel": round(s_us / k_us, 3)})
    result = {"cpu": cpu_model(), "threads": torch.get_num_threads(),
              "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
              "chunk": args.chunk, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{result['cpu']}, {result['threads']} threads; {args.heads} query / "
          f"{args.kv_heads} KV heads of {args.head_dim}; medians of {args.rounds}")
    print(f"{'kind':<11}{'dtype':<10}{'length':>7}{'kernel µs':>12}{'SDPA µs':>12}"
          f"{'SDPA/kernel':>13}")
    for r in rows:
        print(f"{r['kind']:<11}{r['dtype']:<10}{r['length']:>7}{r['kernel_us']:>12.1f}"
              f"{r['sdpa_us']:>12.1f}{r['sdpa_over_kernel']:>12.2f}x")


if __name__ == "__main__":
    main()
