"""PagedAttention in Triton: one kernel for a flat batch that mixes prefill chunks and decodes.

Layouts are those of `kernels.reference` (the oracle). One program owns one *query tile* of
one sequence, one KV head, and one *split* of that sequence's context:

    query rows of a tile (BLOCK_M rows = BLOCK_Q tokens x GROUP query heads of one KV head)

        row r ─▶ token  tile_start + r // GROUP      (a position of this sequence)
               ─▶ head   kv_head * GROUP + r % GROUP (the GQA group shares K/V loads)

    context of sequence b, walked in BLOCK_N-token tiles through its block table

        token p ─▶ block_tables[b, p // BLOCK_SIZE] ─▶ k_cache[block, p % BLOCK_SIZE, kv_head, :]

    grid = (query tiles, KV heads, context splits)

A decode is one token: its tile holds the GROUP heads that share one K/V head, so the K/V
bytes (the whole cost of a decode) are read once per group, not once per query head. A
prefill chunk spans several tiles, each reading context only up to its own causal bound.

When the batch is too small to fill the GPU (few sequences, long contexts: the
latency-critical decode case), the context is also cut into splits ("flash decoding"):
each split writes an unnormalised partial (acc, running max m, running sum l) and a second
small kernel merges them. Split counts come from tensor shapes alone (never from device
values), so a call never waits on the GPU and can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.interpreter_compat import cast, dot, interpreting

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 512  # context tokens per split at least, so its fixed cost stays small


@triton.jit
def _find_sequence(query_start_loc, num_seqs, tile_id, BLOCK_Q: tl.constexpr):
    """The sequence owning virtual tile `tile_id` (binary search, O(log B) scalar loads).

    Sequence b owns the virtual tiles [start(b), start(b + 1)) with
    start(b) = query_start_loc[b] // BLOCK_Q + b: monotone, at least ceil(q_len / BLOCK_Q)
    tiles per sequence, and start(B) = T // BLOCK_Q + B is the grid size. The host never has
    to read query_start_loc to build the grid.
    """
    lo = tile_id * 0                    # tensors, not Python ints: loop-carried values
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(query_start_loc + mid).to(tl.int32) // BLOCK_Q + mid
        lo = tl.where(start <= tile_id, mid, lo)
        hi = tl.where(start <= tile_id, hi, mid - 1)
    return lo


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    scale_log2,                         # softmax scale * log2(e): scores live in base 2
    num_seqs, num_q_heads, num_tokens,
    split_tokens,                       # context tokens per split (a multiple of BLOCK_N)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,           # tokens per KV cache block
    GROUP: tl.constexpr,                # query heads per KV head
    BLOCK_M: tl.constexpr,              # query rows per tile (tokens x heads)
    BLOCK_Q: tl.constexpr,              # query tokens per tile = BLOCK_M // GROUP
    BLOCK_N: tl.constexpr,              # context tokens per inner iteration
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    SPLIT: tl.constexpr,                # write partials for _merge_splits_kernel
    DOT_PRECISION: tl.constexpr,        # "ieee" for fp32 inputs (TF32 would cost 1e-3)
    INTERPRET: tl.constexpr,            # see kernels.interpreter_compat
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    tile_start = (tile_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if tile_start >= q_len:             # one of a sequence's spare virtual tiles
        return
    ctx_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // GROUP                    # query token index within the sequence
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    pos = ctx_len - q_len + tok                         # its position; it sees keys 0..pos
    dim = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dim < HEAD_DIM

    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + dim[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # Context this program reads: up to the causal bound of its last row, within its split.
    last_tok = tl.minimum(tile_start + BLOCK_Q, q_len) - 1
    kv_lo = split * split_tokens
    kv_hi = tl.minimum(ctx_len - q_len + last_tok + 1, kv_lo + split_tokens)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([BLOCK_M], tl.float32)                # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        k_ok = kpos < kv_hi
        # NOTE: masked loads, not just masked scores: past the context the table holds
        # anything (padding) and the last block's tail holds stale data (even NaN).
        block = tl.load(table + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = (kpos % BLOCK_SIZE).to(tl.int64)
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_base + block[:, None] * stride_kb + slot[:, None] * stride_kt + dim[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_base + block[:, None] * stride_vb + slot[:, None] * stride_vt + dim[None, :],
                    mask=kv_mask, other=0.0)

        s = dot(q, tl.trans(k), DOT_PRECISION, INTERPRET) * scale_log2
        visible = (kpos[None, :] <= pos[:, None]) & k_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see no key yet (a split before its position): keep exp2 away from -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        # NOTE: P is rounded to K/V's dtype for the second product, as flash attention does:
        # a bf16 x bf16 tensor-core product, with l_i kept from the unrounded P.
        acc = acc * alpha[:, None] + dot(cast(p, v.dtype, INTERPRET), v, DOT_PRECISION, INTERPRET)
        m_i = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        # partials: acc [S, T, Hq, D], m and l [S, T, Hq], all fp32 and contiguous
        part_row = (split * num_tokens + q_start + tok).to(tl.int64) * num_q_heads + head
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM + dim[None, :], acc, mask=out_mask)
        tl.store(part_m_ptr + part_row, m_i, mask=row_ok)
        tl.store(part_l_ptr + part_row, l_i, mask=row_ok)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)   # only spare rows have l == 0; never stored
        out = acc / l_safe[:, None]
        tl.store(out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + dim[None, :],
                 cast(out, out_ptr.dtype.element_ty, INTERPRET), mask=out_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    num_splits, num_q_heads, num_tokens,
    stride_ot, stride_oh,
    SPLITS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out[t, h] = sum_s acc_s * 2^(m_s - m) / sum_s l_s * 2^(m_s - m), m = max_s m_s."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.arange(0, SPLITS_P2)
    dim = tl.arange(0, HEAD_DIM_P2)
    split_ok = split < num_splits
    dim_ok = dim < HEAD_DIM
    row = (split * num_tokens + token).to(tl.int64) * num_q_heads + head
    m = tl.load(part_m_ptr + row, mask=split_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=split_ok, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + dim[None, :],
                  mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_safe)        # an empty split has m = -inf: weight 0
    l_total = tl.sum(l * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(l_total == 0.0, 1.0, l_total)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dim,
             cast(out, out_ptr.dtype.element_ty, INTERPRET), mask=dim_ok)


@dataclass(slots=True)
class TileConfig:
    """Tile shape and launch options for one kind of batch (tuned on the GPU by the bench)."""

    min_block_m: int    # query rows per tile, at least (tl.dot needs 16; raised to GROUP)
    block_n: int        # context tokens per inner iteration
    num_warps: int
    num_stages: int


# Decode-only batches (T == B): a tile holds 1 token x GROUP heads, so the smallest tile
# tl.dot accepts; more rows would be arithmetic on padding. 128 context tokens per step,
# 4 warps and 3 stages: 10 % under 64 / 4 / 2 and level with the fastest of 12 configs
# tried in bf16 on an H200 (8 warps, which spills under Triton 3.6; bench_paged_attention
# --tune, docs/kernels.md). fp32 decodes (the exactness path) use 64 / 4 / 2, untuned:
# the tuning ran in bf16 only. Batches with prefill chunks: 64 rows, so each K/V
# tile loaded is reused by more query rows.
DECODE_TILES = TileConfig(min_block_m=16, block_n=128, num_warps=4, num_stages=3)
DECODE_TILES_FP32 = TileConfig(min_block_m=16, block_n=64, num_warps=4, num_stages=2)
PREFILL_TILES = TileConfig(min_block_m=64, block_n=64, num_warps=4, num_stages=3)
# Split the context while fewer than this many programs per SM would run: a decode program
# streams K/V, and about 4 fit on an SM at once (registers), all needed to saturate HBM.
TARGET_PROGRAMS_PER_SM = 4


@dataclass(slots=True)
class LaunchPlan:
    """Tile sizes and split count for one call, chosen from shapes only (no device reads)."""

    block_m: int        # query rows per tile
    block_q: int        # query tokens per tile
    block_n: int        # context tokens per inner iteration
    num_tiles: int      # virtual query tiles: T // block_q + B (the grid's first axis)
    num_splits: int
    split_tokens: int   # context tokens per split, a multiple of block_n
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_launch(num_tokens: int, num_seqs: int, group: int, block_size: int,
                max_blocks_per_seq: int, num_kv_heads: int, device: torch.device,
                num_splits: int | None = None, elem_bytes: int = 2) -> LaunchPlan:
    """Pick tiles and the split count for a batch; `num_splits` forces the count (tests).

    The longest context is bounded by the block table's width (a sequence never outgrows
    its table), so splits are sized from max_blocks_per_seq * block_size: tables as wide
    as the batch's longest sequence give the best splits, wider ones only fewer.
    `elem_bytes` is the K/V element size (fp32 decodes take smaller tiles).
    """
    decode_only = num_tokens == num_seqs
    if decode_only:
        tiles = DECODE_TILES if elem_bytes <= 2 else DECODE_TILES_FP32
    else:
        tiles = PREFILL_TILES
    block_m = max(tiles.min_block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    num_tiles = num_tokens // block_q + num_seqs
    max_ctx = max(1, max_blocks_per_seq * block_size)
    if num_splits is None:
        busy_tiles = num_seqs if decode_only else num_tiles   # the rest exit at once
        programs = busy_tiles * num_kv_heads
        sms = _sm_count(device.index or 0) if device.type == "cuda" else 1
        target = sms * TARGET_PROGRAMS_PER_SM
        num_splits = 1
        if programs < target:
            num_splits = min(triton.cdiv(target, programs), triton.cdiv(max_ctx, MIN_SPLIT_TOKENS))
    num_splits = max(1, num_splits)
    split_tokens = triton.cdiv(triton.cdiv(max_ctx, num_splits), tiles.block_n) * tiles.block_n
    num_splits = triton.cdiv(max_ctx, split_tokens)   # rounding may leave fewer splits
    return LaunchPlan(block_m=block_m, block_q=block_q, block_n=tiles.block_n,
                      num_tiles=num_tiles, num_splits=num_splits, split_tokens=split_tokens,
                      num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    num_splits: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a flat batch over paged K/V (see `kernels.reference.paged_attention`).

    query [T, Hq, D]; k_cache / v_cache [num_blocks, block_size, Hkv, D] (any strides, last
    dim contiguous: `kv_cache[layer, 0]` views fit); block_tables [B, max_blocks] int32,
    padded with anything; seq_lens [B]; query_start_loc [B + 1]. Returns [T, Hq, D] in
    query's dtype. Requires seq_lens[b] <= max_blocks * block_size and q_len_b <= seq_lens[b].
    `num_splits` forces the context split count (None: chosen from the shapes); `out`
    [T, Hq, D] (last dim contiguous) receives the result instead of a new tensor.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads "
                         f"({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    if query.stride(-1) != 1:
        query = query.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous head dimension")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} with a contiguous last dim")
    if num_tokens == 0 or num_seqs == 0:
        return out

    plan = plan_launch(num_tokens, num_seqs, group, block_size, block_tables.shape[1],
                       num_kv_heads, query.device, num_splits, k_cache.element_size())
    split = plan.num_splits > 1
    if split:
        part_acc = torch.empty((plan.num_splits, num_tokens, num_q_heads, head_dim),
                               dtype=torch.float32, device=query.device)
        part_m = torch.empty((plan.num_splits, num_tokens, num_q_heads),
                             dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out   # unused when SPLIT is False
    head_dim_p2 = max(16, triton.next_power_of_2(head_dim))
    grid = (plan.num_tiles, num_kv_heads, plan.num_splits)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        part_acc, part_m, part_l,
        scale * LOG2E, num_seqs, num_q_heads, num_tokens, plan.split_tokens,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, BLOCK_M=plan.block_m, BLOCK_Q=plan.block_q,
        BLOCK_N=plan.block_n, HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2, SPLIT=split,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        INTERPRET=interpreting(),
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_m, part_l, plan.num_splits, num_q_heads, num_tokens,
            out.stride(0), out.stride(1),
            SPLITS_P2=triton.next_power_of_2(plan.num_splits), HEAD_DIM=head_dim,
            HEAD_DIM_P2=head_dim_p2, INTERPRET=interpreting(), num_warps=4,
        )
    return out
