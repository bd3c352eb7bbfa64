"""Torch references for the paged KV kernels: the test oracle and the CPU execution path.

KV pool layout (one tensor for every layer, so a block moves across all layers in one op):

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
                           │   └ physical block id (what block tables hold)
                           └ 0 = K, 1 = V

    k_cache = kv_cache[layer, 0]   # [num_blocks, block_size, num_kv_heads, head_dim]
    slot    = block_id * block_size + offset_in_block

The flat batch: the tokens of all scheduled sequences are concatenated. Sequence b owns
query rows query_start_loc[b] : query_start_loc[b+1]; those are its *last* q_len_b tokens,
at positions seq_lens[b] - q_len_b .. seq_lens[b] - 1, and each attends causally to
positions 0 .. its own position of that sequence's paged context. A decode is q_len 1, a
prefill chunk q_len > 1; both mix freely in one batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value [T, Hkv, D] into the cache at slot_mapping [T] (int64; -1 = skip)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    nb, bs = k_cache.shape[:2]
    k_cache.view(nb * bs, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(nb * bs, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of one sequence's paged cache: [length, Hkv, D]."""
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    return cache[block_table[:nblocks].long()].flatten(0, 1)[:length]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a flat batch over paged K/V.

    query:           [T, Hq, D]        T = sum of q_len over sequences
    block_tables:    [B, max_blocks]   int32, padded with anything
    seq_lens:        [B]               context length including this step's tokens
    query_start_loc: [B + 1]           prefix sums of q_len
    returns          [T, Hq, D]        in query's dtype (accumulation in fp32)
    """
    out = torch.empty_like(query)
    hq, hkv = query.shape[1], k_cache.shape[2]
    group = hq // hkv
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, ctx in enumerate(lens):
        q0, q1 = qsl[b], qsl[b + 1]
        if q1 == q0:
            continue
        q = query[q0:q1].float().transpose(0, 1)                       # [Hq, q, D]
        k = gather_context(k_cache, block_tables[b], ctx).float()       # [ctx, Hkv, D]
        v = gather_context(v_cache, block_tables[b], ctx).float()
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)           # [Hq, ctx, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        qlen = q1 - q0
        # query row i sits at position ctx - qlen + i and sees keys 0..that position.
        pos = torch.arange(ctx - qlen, ctx, device=query.device).unsqueeze(1)
        mask = torch.arange(ctx, device=query.device).unsqueeze(0) <= pos   # [q, ctx]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[q0:q1] = o.transpose(0, 1).to(query.dtype)
    return out


def copy_blocks(kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy-on-write: for each [src, dst] row of pairs [P, 2], block dst := block src (all layers)."""
    if pairs.numel() == 0:
        return
    src, dst = pairs[:, 0].long(), pairs[:, 1].long()
    kv_cache[:, :, dst] = kv_cache[:, :, src]


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Move blocks between pools (GPU↔CPU): dst_cache[:, :, d] := src_cache[:, :, s] per [s, d]."""
    if pairs.numel() == 0:
        return
    src, dst = pairs[:, 0].long(), pairs[:, 1].long()
    moved = src_cache[:, :, src.to(src_cache.device)]
    dst_cache[:, :, dst.to(dst_cache.device)] = moved.to(dst_cache.device)
