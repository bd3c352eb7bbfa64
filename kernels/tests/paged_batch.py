"""Random paged batches for the kernel tests, with poison wherever a kernel must not look.

A batch is a list of (context_len, q_len) per sequence. Its K/V live in one
[1, 2, num_blocks, block_size, Hkv, D] pool (so k_cache / v_cache are strided views, as
the executor passes them), in blocks drawn at random. Everything a correct kernel never
reads is poison: the tail of each sequence's last block, the free blocks, and the block
right after each table row's last real entry are NaN; the rest of the row's padding is a
block id far outside the pool. A kernel that reads past a context turns its output NaN,
which no tolerance accepts, or faults.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OUT_OF_POOL = 1 << 30   # a block id far past any test pool


@dataclass(slots=True)
class PagedBatch:
    query: torch.Tensor             # [T, Hq, D]
    kv_cache: torch.Tensor          # [1, 2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor      # [B, max_blocks] int32, padded with poison
    seq_lens: torch.Tensor          # [B] int32
    query_start_loc: torch.Tensor   # [B + 1] int32
    scale: float

    @property
    def k_cache(self) -> torch.Tensor:
        return self.kv_cache[0, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.kv_cache[0, 1]

    def args(self):
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)


def make_batch(seqs: list[tuple[int, int]], *, num_kv_heads: int, group: int, head_dim: int,
               block_size: int, dtype: torch.dtype, seed: int = 0,
               strided_query: bool = False) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3          # + the padding block + 2 free blocks
    shape = (1, 2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.full(shape, float("nan"), dtype=torch.float32)
    order = torch.randperm(num_blocks, generator=gen)
    pad_block = int(order[-1])
    max_blocks = max(blocks_per_seq) + 2          # every row has 2+ padding entries
    tables = torch.full((len(seqs), max_blocks), pad_block, dtype=torch.int32)
    used = 0
    for b, (ctx, _) in enumerate(seqs):
        ids = order[used:used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        tables[b, :len(ids)] = ids.to(torch.int32)
        tables[b, len(ids) + 1:] = OUT_OF_POOL      # following these would fault on a GPU
        data = torch.randn((2, len(ids) * block_size, num_kv_heads, head_dim), generator=gen)
        data[:, ctx:] = float("nan")              # the last block's unwritten tail
        kv_cache[0, :, ids] = data.view(2, len(ids), block_size, num_kv_heads, head_dim)
    num_tokens = sum(q for _, q in seqs)
    num_q_heads = num_kv_heads * group
    width = num_q_heads + 2 * num_kv_heads if strided_query else num_q_heads
    # strided_query: a view into a fused qkv projection, rows wider than Hq * D
    fused = torch.randn((num_tokens, width, head_dim), generator=gen).to(DEVICE, dtype)
    query = fused[:, :num_q_heads]
    qsl = [0]
    for _, q in seqs:
        qsl.append(qsl[-1] + q)
    return PagedBatch(
        query=query,
        kv_cache=kv_cache.to(device=DEVICE, dtype=dtype),
        block_tables=tables.to(DEVICE),
        seq_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        scale=head_dim ** -0.5,
    )
