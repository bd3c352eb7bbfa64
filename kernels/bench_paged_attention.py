"""Decode benchmark of the Triton PagedAttention kernel on a CUDA GPU.

Llama-3-8B attention (32 query heads, 8 KV heads, head dim 128) in bf16, one decode token
per sequence, every sequence at the same context length, its blocks scattered at random
over the pool. For each (batch, context) it reports:

- the kernel's time (triton.testing.do_bench: CUDA events, L2 flushed between runs,
  median), the split count it chose, and its bandwidth: K/V bytes read / time;
- that bandwidth as a fraction of this GPU's device-to-device copy bandwidth, measured
  in the same run (read + write bytes / time of one large copy);
- torch SDPA on contiguous K/V holding the same data (the 4 query heads of a KV head
  passed as 4 queries of that head, which is exactly GQA decode), its time, and the
  largest difference between the two outputs.

    python -m kernels.bench_paged_attention             # the full sweep, ~20 s on an H200
    python -m kernels.bench_paged_attention --json bench.json --plot docs/kernels_decode.png
    python -m kernels.bench_paged_attention --batches 1,64 --contexts 4096 --tune
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128   # Llama-3-8B
DTYPE = torch.bfloat16
GIB = 1 << 30


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def measure_copy_bandwidth(do_bench) -> float:
    """Bytes per second of one 2 GiB device-to-device copy, counting read + write."""
    src = torch.empty(GIB, dtype=torch.bfloat16, device="cuda")   # 2 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * GIB * 2 / (ms * 1e-3)


def _make_case(batch: int, context: int, block_size: int, gen: torch.Generator):
    """A pool with `batch` sequences of `context` tokens in randomly scattered blocks."""
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq + 1
    kv_cache = torch.empty((1, 2, num_blocks, block_size, KV_HEADS, HEAD_DIM), dtype=DTYPE,
                           device="cuda")
    kv_cache.normal_(generator=gen)
    order = torch.randperm(num_blocks, device="cuda", generator=gen)[:batch * blocks_per_seq]
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    query = torch.randn((batch, Q_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda", generator=gen)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return kv_cache, block_tables, query, seq_lens, query_start_loc


def _contiguous(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """One of K/V of every sequence as SDPA wants it: [B, Hkv, context, D], contiguous."""
    batch = block_tables.shape[0]
    gathered = cache[block_tables.long()]                     # [B, blocks, bs, Hkv, D]
    return gathered.view(batch, -1, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()


def bench_case(batch: int, context: int, block_size: int, copy_bw: float, sdpa: bool,
               do_bench, paged_attention, plan_launch) -> dict:
    row = {"batch": batch, "context": context, "block_size": block_size}
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    row["kv_bytes"] = kv_bytes
    free, _ = torch.cuda.mem_get_info()
    if kv_bytes + GIB > free:
        row["skipped"] = f"pool of {kv_bytes / GIB:.1f} GiB does not fit in {free / GIB:.1f} GiB"
        return row
    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + context)
    kv_cache, tables, query, seq_lens, qsl = _make_case(batch, context, block_size, gen)
    scale = HEAD_DIM ** -0.5
    args = (query, kv_cache[0, 0], kv_cache[0, 1], tables, seq_lens, qsl, scale)
    plan = plan_launch(batch, batch, Q_HEADS // KV_HEADS, block_size, tables.shape[1],
                       KV_HEADS, query.device)
    row["num_splits"] = plan.num_splits
    ms = do_bench(lambda: paged_attention(*args), warmup=10, rep=60, return_mode="median")
    row["paged_us"] = ms * 1e3
    row["paged_gbps"] = kv_bytes / (ms * 1e-3) / 1e9
    row["fraction_of_copy_bw"] = kv_bytes / (ms * 1e-3) / copy_bw
    out = paged_attention(*args)

    free, _ = torch.cuda.mem_get_info()
    if not sdpa:
        pass
    elif 1.6 * kv_bytes + GIB > free:   # both contiguous K/V plus one gather in flight
        row["sdpa_skipped"] = "contiguous K/V copy does not fit"
    else:
        k = _contiguous(kv_cache[0, 0], tables)
        v = _contiguous(kv_cache[0, 1], tables)
        q = query.view(batch, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)  # group heads as rows
        sdpa_fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        ms_sdpa = do_bench(sdpa_fn, warmup=10, rep=60, return_mode="median")
        row["sdpa_us"] = ms_sdpa * 1e3
        row["speedup_vs_sdpa"] = ms_sdpa / ms
        expected = sdpa_fn().reshape(batch, Q_HEADS, HEAD_DIM)
        row["max_abs_diff_vs_sdpa"] = (out.float() - expected.float()).abs().max().item()
        del k, v
    del kv_cache, tables, query, out
    torch.cuda.empty_cache()
    return row


def tune(do_bench, paged_attention, plan_launch, pa_module, block_size: int) -> dict:
    """Try a few decode tile configs on three shapes; keep the best total time."""
    shapes = [(1, 32768), (16, 8192), (128, 2048)]
    configs = [(bn, w, s) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
    results = []
    for bn, warps, stages in configs:
        pa_module.DECODE_TILES = pa_module.TileConfig(16, bn, warps, stages)
        total = 0.0
        for batch, context in shapes:
            row = bench_case(batch, context, block_size, 1.0, False, do_bench,
                             paged_attention, plan_launch)
            total += row.get("paged_us", float("inf"))
        results.append({"block_n": bn, "num_warps": warps, "num_stages": stages,
                        "total_us": total})
        print(f"tune: block_n={bn:3d} warps={warps} stages={stages}: {total:9.1f} us over "
              f"{shapes}", flush=True)
    best = min(results, key=lambda r: r["total_us"])
    pa_module.DECODE_TILES = pa_module.TileConfig(16, best["block_n"], best["num_warps"],
                                                  best["num_stages"])
    return {"shapes": shapes, "results": results, "best": best}


def markdown(rows: list[dict]) -> str:
    lines = ["| batch | context | splits | paged µs | GB/s | of copy BW | SDPA µs | "
             "speed-up vs SDPA | max diff |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['batch']} | {r['context']} | skipped: {r['skipped']} "
                         "| | | | | | |")
            continue
        sdpa = (f"{r['sdpa_us']:.1f} | {r['speedup_vs_sdpa']:.2f}x | "
                f"{r['max_abs_diff_vs_sdpa']:.1e}" if "sdpa_us" in r else
                f"{r.get('sdpa_skipped', 'not run')} | | ")
        lines.append(f"| {r['batch']} | {r['context']} | {r['num_splits']} | "
                     f"{r['paged_us']:.1f} | {r['paged_gbps']:.0f} | "
                     f"{100 * r['fraction_of_copy_bw']:.0f} % | {sdpa} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, copy_bw: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for batch in sorted({r["batch"] for r in rows}):
        pts = [(r["context"], r["paged_gbps"]) for r in rows
               if r["batch"] == batch and "paged_gbps" in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"batch {batch}")
    ax.axhline(copy_bw / 1e9, color="gray", linestyle="--", label="device copy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("K/V read bandwidth (GB/s)")
    ax.set_title("PagedAttention decode, Llama-3-8B heads, bf16")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description="Benchmark the Triton PagedAttention decode "
                                                 "kernel against the GPU's copy bandwidth "
                                                 "and torch SDPA.")
    parser.add_argument("--batches", type=_ints, default=[1, 4, 16, 64, 256])
    parser.add_argument("--contexts", type=_ints, default=[512, 2048, 8192, 32768])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-sdpa", action="store_true", help="skip the SDPA comparison")
    parser.add_argument("--tune", action="store_true", help="pick decode tiles first")
    parser.add_argument("--json", metavar="PATH", help="write all results as JSON here")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of bandwidth vs context")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_paged_attention needs a CUDA GPU (none is visible to torch here); "
                 "run it on a GPU machine. Correctness on the CPU: pytest kernels/tests")

    import triton.testing
    from kernels import paged_attention as pa

    started = time.time()
    do_bench = triton.testing.do_bench
    device = torch.cuda.get_device_properties(0)
    copy_bw = measure_copy_bandwidth(do_bench)
    torch.cuda.empty_cache()
    print(f"{device.name}, {device.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}; device copy bandwidth {copy_bw / 1e9:.0f} GB/s",
          flush=True)
    tuned = None
    if args.tune:
        tuned = tune(do_bench, pa.paged_attention, pa.plan_launch, pa, args.block_size)
        print(f"tune: best {tuned['best']}", flush=True)
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            row = bench_case(batch, context, args.block_size, copy_bw, not args.no_sdpa,
                             do_bench, pa.paged_attention, pa.plan_launch)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(markdown(rows))
    print(f"\n{len(rows)} cases in {time.time() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.name, "sms": device.multi_processor_count,
                       "torch": torch.__version__, "triton": triton.__version__,
                       "copy_bandwidth_gbps": copy_bw / 1e9,
                       "decode_tiles": str(pa.DECODE_TILES), "tune": tuned, "rows": rows},
                      f, indent=1)
    if args.plot:
        plot(rows, args.plot, copy_bw)


if __name__ == "__main__":
    main()
