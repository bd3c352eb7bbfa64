"""Compile every Triton kernel for Hopper (sm_90) ahead of time, without a GPU.

The interpreter runs kernels as numpy code, so it never sees what only the compiler checks
(types of loop-carried values, layouts, shared memory, registers). This compiles the
launch configurations `plan_launch` picks for Llama-3-8B-like shapes through Triton's own
ptxas and reports registers, stack (spills) and shared memory per kernel.

    python -m kernels.tests.hopper_compile          # a table
    python -m kernels.tests.hopper_compile --json   # one JSON object per line

Must run with TRITON_INTERPRET unset (the interpreter replaces kernels with Python).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import cache_ops
from kernels import paged_attention as pa

HOPPER = GPUTarget("cuda", 90, 32)
# Integer args whose values the JIT launcher would see divisible by 16 (strides of
# aligned tensors): marking them lets the compiler vectorise as it will on the device.
ALIGNED_INTS = {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_kt",
                "stride_kh", "stride_vb", "stride_vt", "stride_vh", "stride_kcb", "stride_kct",
                "stride_kch", "stride_vcb", "stride_vct", "stride_vch",
                "src_stride_layer", "src_stride_kv", "src_stride_block",
                "dst_stride_layer", "dst_stride_kv", "dst_stride_block"}


def _compile(name: str, fn, pointers: dict[str, str], floats: set[str],
             constexprs: dict, num_warps: int, num_stages: int) -> dict:
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in pointers:
            signature[arg] = "*" + pointers[arg]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in floats:
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            if arg in ALIGNED_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=HOPPER,
                            options={"num_warps": num_warps, "num_stages": num_stages})
    row = {"kernel": name, "shared_bytes": kernel.metadata.shared, "registers": None,
           "stack_bytes": None}
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if cuobjdump.exists():
        cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagedserve_{os.getpid()}.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True).stdout
        cubin.unlink()
        for field in usage.split():
            if field.startswith("REG:"):
                row["registers"] = int(field[4:])
            elif field.startswith("STACK:"):
                row["stack_bytes"] = int(field[6:])
    return row


def _attention(name: str, dtype: str, num_tokens: int, num_seqs: int, group: int,
               head_dim: int = 128, block_size: int = 16, max_blocks: int = 2048,
               num_kv_heads: int = 8) -> dict:
    plan = pa.plan_launch(num_tokens, num_seqs, group, block_size, max_blocks, num_kv_heads,
                          torch.device("cpu"), num_splits=1 if num_seqs > 1 else 8,
                          elem_bytes=4 if dtype == "fp32" else 2)
    io = {p: dtype for p in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
    ints = {p: "i32" for p in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")}
    parts = {p: "fp32" for p in ("part_acc_ptr", "part_m_ptr", "part_l_ptr")}
    constexprs = dict(BLOCK_SIZE=block_size, GROUP=group, BLOCK_M=plan.block_m,
                      BLOCK_Q=plan.block_q, BLOCK_N=plan.block_n, HEAD_DIM=head_dim,
                      HEAD_DIM_P2=max(16, triton.next_power_of_2(head_dim)),
                      SPLIT=plan.num_splits > 1,
                      DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", INTERPRET=False)
    row = _compile(name, pa._paged_attention_kernel, io | ints | parts, {"scale_log2"},
                   constexprs, plan.num_warps, plan.num_stages)
    row["config"] = f"{dtype} M{plan.block_m} N{plan.block_n} w{plan.num_warps} s{plan.num_stages}"
    return row


def compile_all() -> list[dict]:
    rows = [
        _attention("paged_attention decode", "bf16", 64, 64, group=4),
        _attention("paged_attention decode gqa8", "fp16", 64, 64, group=8),
        _attention("paged_attention split decode", "bf16", 1, 1, group=4),
        _attention("paged_attention prefill", "bf16", 4096, 4, group=4),
        _attention("paged_attention prefill d64 gqa3", "bf16", 4096, 4, group=3, head_dim=64,
                   num_kv_heads=3),
        _attention("paged_attention fp32 prefill", "fp32", 64, 8, group=3, head_dim=64,
                   num_kv_heads=1),
        _attention("paged_attention fp32 decode", "fp32", 64, 64, group=4),
        _attention("paged_attention fp32 split decode", "fp32", 1, 1, group=8),
    ]
    merge = _compile("merge_splits", pa._merge_splits_kernel,
                     {"out_ptr": "bf16", "part_acc_ptr": "fp32", "part_m_ptr": "fp32",
                      "part_l_ptr": "fp32"}, set(),
                     dict(SPLITS_P2=16, HEAD_DIM=128, HEAD_DIM_P2=128, INTERPRET=False), 4, 1)
    write = _compile("write_kv", cache_ops._write_kv_kernel,
                     {"key_ptr": "bf16", "value_ptr": "bf16", "k_cache_ptr": "bf16",
                      "v_cache_ptr": "bf16", "slot_mapping_ptr": "i64"}, set(),
                     dict(NUM_HEADS=8, HEADS_P2=8, HEAD_DIM=128, HEAD_DIM_P2=128,
                          BLOCK_SIZE=16, INTERPRET=False), 4, 1)
    move = _compile("move_blocks", cache_ops._move_blocks_kernel,
                    {"src_ptr": "bf16", "dst_ptr": "bf16", "src_index_ptr": "i64",
                     "dst_index_ptr": "i64"}, set(),
                    dict(BLOCK_NUMEL=16 * 8 * 128, CHUNK=cache_ops.CHUNK), 4, 1)
    for row, config in ((merge, "bf16 D128"), (write, "bf16 Hkv8 D128 bs16"),
                        (move, f"bf16 chunk {cache_ops.CHUNK}")):
        row["config"] = config
    return rows + [merge, write, move]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per kernel")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter cannot compile kernels")
    for row in compile_all():
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{row['kernel']:34s} {row['config']:24s} regs {row['registers']} "
                  f"stack {row['stack_bytes']} B  smem {row['shared_bytes']} B")


if __name__ == "__main__":
    main()
