"""The kernel entry points the executor calls: Triton on CUDA tensors, torch reference elsewhere.

Signatures and layouts are those of `kernels.reference` (read its docstring). The Triton
modules are imported lazily, so a CPU-only process never compiles (or interprets) them.
"""
from __future__ import annotations

import torch

from kernels import reference


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    if _on_cuda(k_cache):
        from kernels.cache_ops import write_kv as triton_write_kv
        return triton_write_kv(key, value, k_cache, v_cache, slot_mapping)
    return reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    if _on_cuda(query):
        from kernels.paged_attention import paged_attention as triton_paged_attention
        return triton_paged_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                      query_start_loc, scale)
    return reference.paged_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                     query_start_loc, scale)


def copy_blocks(kv_cache, pairs) -> None:
    if _on_cuda(kv_cache):
        from kernels.cache_ops import copy_blocks as triton_copy_blocks
        return triton_copy_blocks(kv_cache, pairs)
    return reference.copy_blocks(kv_cache, pairs)


def swap_blocks(src_cache, dst_cache, pairs) -> None:
    if _on_cuda(src_cache) or _on_cuda(dst_cache):
        from kernels.cache_ops import swap_blocks as triton_swap_blocks
        return triton_swap_blocks(src_cache, dst_cache, pairs)
    return reference.swap_blocks(src_cache, dst_cache, pairs)
