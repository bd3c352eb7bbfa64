"""Paged attention for one flat batch: per-step metadata plus a fast CPU path.

On CUDA every call goes to `kernels.ops` (Triton). On the CPU, `kernels.reference` loops
over sequences in Python, which is too slow for large decode batches, so this module
splits the batch in two and keeps `kernels.reference` as the oracle in the tests:

    rows  0 .. num_decode-1            decodes (q_len 1), all in ONE call:
                                       the C kernel (cpu_kernels.c) reads K/V in
                                       place from the pool, the query heads of a KV
                                       head together or one at a time, whichever is
                                       faster on this CPU (`pick_decode_heads`);
                                       without a C compiler, one padded
                                       gather of every sequence's blocks + one batched SDPA
                                       with a length mask
    rows  num_decode .. T-1            prefill chunks, one call each (few per step, each
                                       with many query rows): the C kernel, or torch's SDPA
                                       where that is faster on this CPU (`pick_prefill_paths`:
                                       SDPA's bf16 runs on AMX) or the kernel declines; a chunk
                                       that starts at position 0 attends to its fresh K/V
                                       directly, a later one reads its context from the pool

The step plan orders its rows that way (shared/messages.py, StepPlan) and the runner keeps
the plan's order.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import ops
from services.executor import cpu_kernels

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefillChunk:
    q_start: int                   # first query row in the flat batch
    q_end: int
    context_len: int               # tokens of the sequence in the cache after this step
    block_ids: torch.Tensor | None  # [ceil(context_len / block_size)] int32; None: fresh prompt
    mask: torch.Tensor | None      # [q_len, context_len] bool; None: plain causal


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [T] int64: block_id * block_size + offset of each token
    # The kernels.ops / kernels.reference form (used on CUDA):
    block_tables: torch.Tensor     # [B, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor         # [B] int32: context length after this step
    query_start_loc: torch.Tensor  # [B + 1] int32
    # The CPU form:
    num_decode: int = 0
    decode_tables: torch.Tensor | None = None     # [num_decode, max_blocks] int32 (C kernel)
    decode_lens: torch.Tensor | None = None       # [num_decode] int32
    decode_max_len: int = 0
    decode_block_ids: torch.Tensor | None = None  # [num_decode * max_blocks] int64, padded
    decode_mask: torch.Tensor | None = None       # [num_decode, 1, 1, max_blocks * block_size]
    prefills: list[PrefillChunk] | None = None
    positions: torch.Tensor | None = None          # [T] int64: each token's position
    # Whether the C kernel runs (fresh, continuing) prefill chunks, else SDPA: the model
    # runner's `pick_prefill_paths`, set on each step's metadata.
    prefill_kernel: tuple[bool, bool] = (True, True)
    # How many query heads of a KV head the C decode kernel takes at once (at most): the
    # runner's `pick_decode_heads`.
    decode_heads_at_once: int = cpu_kernels.HEADS_AT_ONCE

    @classmethod
    def build(cls, block_tables: list[list[int]], num_computed: list[int],
              num_tokens: list[int], block_size: int, device: torch.device) -> "AttentionMetadata":
        """Metadata for sequences scheduled in this order (decodes, q_len 1, first: they run
        as one batch).

        block_tables[b] must cover positions < num_computed[b] + num_tokens[b].
        """
        nseq = len(num_tokens)
        ctx = [c + n for c, n in zip(num_computed, num_tokens)]
        nblocks = [-(-x // block_size) for x in ctx]
        max_blocks = max(nblocks, default=1)
        padded = [bt[:nb] + [0] * (max_blocks - nb) for bt, nb in zip(block_tables, nblocks)]
        tables = torch.tensor(padded, dtype=torch.int64).view(nseq, max_blocks)
        q_lens = torch.tensor(num_tokens, dtype=torch.int64)
        starts = torch.tensor(num_computed, dtype=torch.int64)
        qsl = torch.zeros(nseq + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=qsl[1:])
        # Per token: its sequence, its position, and its slot in the pool.
        seq_of = torch.repeat_interleave(torch.arange(nseq), q_lens)
        positions = torch.arange(int(qsl[-1])) - qsl[seq_of] + starts[seq_of]
        slots = tables[seq_of, positions // block_size] * block_size + positions % block_size
        meta = cls(slot_mapping=slots, block_tables=tables.to(torch.int32),
                   seq_lens=torch.tensor(ctx, dtype=torch.int32),
                   query_start_loc=qsl.to(torch.int32))
        meta.positions = positions
        if device.type == "cuda":
            meta.slot_mapping = slots.to(device, non_blocking=True)
            meta.positions = positions.to(device, non_blocking=True)
            meta.block_tables = meta.block_tables.to(device, non_blocking=True)
            meta.seq_lens = meta.seq_lens.to(device, non_blocking=True)
            meta.query_start_loc = meta.query_start_loc.to(device, non_blocking=True)
            return meta
        # The leading run of one-token rows is the decode batch; a one-token row after it (a
        # prefill chunk of one token) runs as a chunk.
        nd = 0
        while nd < nseq and num_tokens[nd] == 1:
            nd += 1
        meta.num_decode = nd
        if nd:
            dmax = max(nblocks[:nd])
            meta.decode_max_len = max(ctx[:nd])
            if cpu_kernels.kernels() is not None:
                meta.decode_tables = meta.block_tables[:nd, :dmax].contiguous()
                meta.decode_lens = meta.seq_lens[:nd]
            else:
                meta.decode_block_ids = tables[:nd, :dmax].reshape(-1)
                lens = torch.tensor(ctx[:nd], dtype=torch.int64)
                meta.decode_mask = (torch.arange(dmax * block_size) < lens[:, None]).view(
                    nd, 1, 1, -1)
        meta.prefills = []
        qs = qsl.tolist()
        for b in range(nd, nseq):
            c, n = num_computed[b], num_tokens[b]
            if c == 0:
                meta.prefills.append(PrefillChunk(qs[b], qs[b + 1], n, None, None))
                continue
            mask = torch.arange(c + n)[None, :] <= torch.arange(c, c + n)[:, None]
            # int32, contiguous: the C kernel's block table (index_select takes it too)
            meta.prefills.append(PrefillChunk(qs[b], qs[b + 1], c + n,
                                              tables[b, :nblocks[b]].to(torch.int32), mask))
        return meta


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store this step's key/value [T, Hkv, D] at meta.slot_mapping."""
    if k_cache.is_cuda:
        ops.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        return
    nb, bs = k_cache.shape[:2]
    # index_copy_ into a flat [slots, Hkv, D] view: no mask, no intermediate copy (a cast
    # first where the cache is 16-bit under an fp32 model).
    k_cache.view(nb * bs, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping,
                                                          key.to(k_cache.dtype))
    v_cache.view(nb * bs, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping,
                                                          value.to(v_cache.dtype))


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Causal attention of the flat batch: query [T, Hq, D] -> [T, Hq, D].

    key/value [T, Hkv, D] are this step's (already written to the cache); the CPU path
    uses them directly for chunks that start at position 0.
    """
    if query.is_cuda:
        return ops.paged_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                   meta.query_start_loc, scale)
    return cpu_paged_attention(query, key, value, k_cache, v_cache, meta, scale)


def cpu_paged_attention(query, key, value, k_cache, v_cache, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
    out = torch.empty(query.shape, dtype=query.dtype)
    nb = k_cache.shape[0]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(nb, -1)       # one row per block: index_select copies whole blocks
    v_flat = v_cache.view(nb, -1)
    nd = meta.num_decode
    if nd and meta.decode_tables is not None:
        # an fp32 query: the kernel writes its rows of `out` itself (no copy)
        direct = out[:nd] if out.dtype == torch.float32 else None
        o = cpu_kernels.decode_attention(query[:nd], k_cache, v_cache, meta.decode_tables,
                                         meta.decode_lens, meta.decode_max_len, scale, out=direct,
                                         heads_at_once=meta.decode_heads_at_once)
        if direct is None:
            out[:nd] = o
    elif nd:
        # [nd, max_ctx, Hkv, D] -> [nd, Hkv, max_ctx, D] as a view (SDPA takes strides).
        k = k_flat.index_select(0, meta.decode_block_ids).to(query.dtype).view(
            nd, -1, hkv, d).transpose(1, 2)
        v = v_flat.index_select(0, meta.decode_block_ids).to(query.dtype).view(
            nd, -1, hkv, d).transpose(1, 2)
        # The Hq/Hkv query heads of one KV head become its query rows: no K/V repeat (GQA).
        q = query[:nd].reshape(nd, hkv, -1, d)                       # [nd, Hkv, group, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = o.reshape(nd, -1, d)
    for ch in meta.prefills:
        paged = ch.block_ids is not None      # K/V partly from earlier steps: from the pool
        if meta.prefill_kernel[paged] and cpu_kernels.prefill_attention(
                query[ch.q_start:ch.q_end], k_cache if paged else key[ch.q_start:ch.q_end],
                v_cache if paged else value[ch.q_start:ch.q_end], out[ch.q_start:ch.q_end],
                scale, table=ch.block_ids if paged else None,
                start=ch.context_len - (ch.q_end - ch.q_start)):
            continue
        q = query[ch.q_start:ch.q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        if ch.block_ids is None:
            k = key[ch.q_start:ch.q_end].transpose(0, 1).unsqueeze(0)
            v = value[ch.q_start:ch.q_end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            n = ch.context_len
            k = k_flat.index_select(0, ch.block_ids).to(query.dtype).view(-1, hkv, d)[:n]
            v = v_flat.index_select(0, ch.block_ids).to(query.dtype).view(-1, hkv, d)[:n]
            k, v = k.transpose(0, 1), v.transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k.unsqueeze(0), v.unsqueeze(0),
                                               attn_mask=ch.mask, scale=scale, enable_gqa=True)
        out[ch.q_start:ch.q_end] = o[0].transpose(0, 1)
    return out


def _medians_in_turns(candidates: tuple, run, rounds: int) -> dict:
    """Seconds of run(c) for each candidate: the median of `rounds` timings, the candidates
    in turns (their order reversed every other round), after one round that warms them up."""
    times: dict = {c: [] for c in candidates}
    for r in range(rounds + 1):
        for c in (candidates if r % 2 else candidates[::-1]):
            t0 = time.perf_counter()
            run(c)
            if r:
                times[c].append(time.perf_counter() - t0)
    return {c: statistics.median(t) for c, t in times.items()}


# SDPA is picked over the C prefill kernel only when it times this much faster: closer, the
# timings at start do not tell them apart.
PREFILL_MARGIN = 1.05


def pick_prefill_paths(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                       kv_dtype: torch.dtype, block_size: int) -> tuple[bool, bool]:
    """Whether the C kernel (True) or torch's SDPA runs prefill chunks that start a sequence
    and chunks that continue one, for this model's heads and dtypes on this CPU.

    Which is faster depends on the CPU: on the AMD EPYC Zen 4 the kernel is 1.6-2x SDPA in
    fp32 and bf16; on an Intel Xeon with AMX SDPA's bf16 products run on the AMX tiles and
    take 0.4-0.6 of the kernel's time, while in fp32 the kernel is 1.15-1.25x SDPA
    (loadtest/bench_prefill_attention.py). So both are timed on one chunk of each kind
    (256 tokens; a continuing one at the end of a context of 1,024), at the first start
    on a machine, and the choice remembered (`cpu_kernels.remembered`, like the GEMM's).
    PAGEDSERVE_PREFILL_ATTENTION=kernel|sdpa forces one for both kinds."""
    if cpu_kernels.kernels() is None:
        return (False, False)
    forced = os.environ.get("PAGEDSERVE_PREFILL_ATTENTION", "auto")
    if forced in ("kernel", "sdpa"):
        return (forced == "kernel",) * 2
    paths = []
    for paged in (False, True):
        kind = "continuing" if paged else "fresh"
        key = [heads, kv_heads, head_dim, str(dtype), str(kv_dtype), block_size, PREFILL_MARGIN]
        paths.append(cpu_kernels.remembered(
            "attention", f"{kind} prefill attention", key, ("kernel", "sdpa"),
            lambda: _faster_prefill(heads, kv_heads, head_dim, dtype, kv_dtype, block_size,
                                    paged, kind)) == "kernel")
    return tuple(paths)


def _faster_prefill(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                    kv_dtype: torch.dtype, block_size: int, paged: bool, kind: str) -> str:
    """"kernel" or "sdpa": the faster on one chunk of 256 tokens (medians of 5 in turns),
    fresh or at the end of a context of 1,024 tokens in a pool of shuffled blocks; random
    values (the cost does not depend on them)."""
    n, context = 256, 1024 if paged else 256
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    nblocks = -(-context // block_size)
    # the chunk's metadata as a step builds it: its blocks in shuffled order
    meta = AttentionMetadata.build([torch.randperm(nblocks, generator=g).tolist()],
                                   [context - n], [n], block_size, torch.device("cpu"))
    pools = [torch.randn(nblocks, block_size, kv_heads, head_dim, generator=g).to(kv_dtype)
             for _ in range(2)]
    own = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)]
    def run(use_kernel: bool) -> None:
        meta.prefill_kernel = (use_kernel, use_kernel)
        cpu_paged_attention(q, *own, *pools, meta, scale)
    with torch.inference_mode():
        medians = _medians_in_turns((True, False), run, 5)
    kernel, sdpa = medians[True], medians[False]
    best = "sdpa" if sdpa * PREFILL_MARGIN < kernel else "kernel"
    log.info("%s prefill attention: %s (256 tokens, %s model, %s pool: kernel %.0f us, "
             "SDPA %.0f us)", kind, best, str(dtype)[6:], str(kv_dtype)[6:], kernel * 1e6,
             sdpa * 1e6)
    return best


# The pool `_faster_decode` reads each step: at least this much, so that it comes from
# memory as a serving batch's context does, not from the caches.
DECODE_TIMING_BYTES = 128 << 20
DECODE_TIMING_ROUNDS = 10


def pick_decode_heads(heads: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
                      block_size: int) -> int:
    """How many query heads of a KV head the C decode kernel takes at once in its weighted
    sum of V: cpu_kernels.HEADS_AT_ONCE (each vector of V loaded and widened once for all of
    them) or 1 (one head at a time), whichever is faster here. The sums are the same.

    Which one is faster depends on the CPU and the cache's dtype (bench_decode_attention.py
    --heads-at-once 4,1): on the AMD EPYC Zen 4, 64 sequences of 300 tokens over 30 layers
    took 0.94x the time one head at a time with an fp32 cache and 1.09x with a bf16 one; on
    the Intel Xeon of family 6 model 167 the heads together were 1.01-1.27x faster in
    both. So both are timed at the first start on a machine (64 sequences of 256 tokens,
    from memory) and the choice remembered, as `pick_prefill_paths`'s."""
    together = cpu_kernels.HEADS_AT_ONCE
    if cpu_kernels.kernels() is None or heads <= kv_heads:
        return together                  # no kernel, or nothing to take together
    key = [heads, kv_heads, head_dim, str(kv_dtype), block_size, DECODE_TIMING_BYTES]
    best = cpu_kernels.remembered(
        "attention", "decode attention heads", key, ("together", "one at a time"),
        lambda: _faster_decode(heads, kv_heads, head_dim, kv_dtype, block_size))
    return together if best == "together" else 1


def _faster_decode(heads: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
                   block_size: int) -> str:
    """"together" or "one at a time": the faster decode step (medians of 10 in turns) of 64
    sequences of 256 tokens, over as many layers' pools as make DECODE_TIMING_BYTES; blocks
    in shuffled order, random values (the cost does not depend on them)."""
    batch, context = 64, 256
    per_seq = -(-context // block_size)
    nblocks = batch * per_seq
    layer_bytes = 2 * nblocks * block_size * kv_heads * head_dim * kv_dtype.itemsize
    g = torch.Generator().manual_seed(0)
    pools = [[torch.empty(nblocks, block_size, kv_heads, head_dim, dtype=kv_dtype).uniform_(
        -1, 1, generator=g) for _ in range(2)]
        for _ in range(-(-DECODE_TIMING_BYTES // layer_bytes))]
    tables = torch.randperm(nblocks, generator=g).view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=g)
    out = torch.empty(batch, heads, head_dim)
    def step(n: int) -> None:
        for k, v in pools:
            cpu_kernels.decode_attention(q, k, v, tables, lens, context, head_dim ** -0.5,
                                         out=out, heads_at_once=n)
    # (the round that warms up also pages the pools in)
    medians = _medians_in_turns((cpu_kernels.HEADS_AT_ONCE, 1), step, DECODE_TIMING_ROUNDS)
    together, one = medians[cpu_kernels.HEADS_AT_ONCE], medians[1]
    best = "one at a time" if one < together else "together"
    log.info("decode attention: query heads %s (%s pool, %d layers of %d x %d tokens: "
             "together %.2f ms, one at a time %.2f ms)", best, str(kv_dtype)[6:], len(pools),
             batch, context, together * 1e3, one * 1e3)
    return best
