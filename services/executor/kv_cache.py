"""The physical KV pool and the CPU swap pool: sizing, allocation, and the cache operations.

Both pools share the layout of kernels/reference.py, so one index op moves a block across
every layer at once:

    pool: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
                       └ 0 = K, 1 = V

On a GPU the main pool lives in device memory and is sized from what is left after the
weights and one profiling forward; on the CPU it is sized from `kv_cache_gib`. The swap
pool is always in host memory (pinned on GPU hosts so copies run at full PCIe speed).
"""
from __future__ import annotations

import torch

from kernels import ops

GIB = 1 << 30


def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem


def blocks_in(budget_bytes: float, one_block_bytes: int) -> int:
    """How many whole blocks fit in a byte budget (never negative)."""
    return max(0, int(budget_bytes // one_block_bytes))


def gpu_kv_budget_bytes(device: torch.device, gpu_memory_utilization: float) -> int:
    """Bytes the GPU pool may take, measured right after a profiling forward.

    The process may hold `utilization * total` bytes; from that subtract the peak that torch
    allocated (weights + activations of the profiling forward) and whatever memory other
    users of the device hold outside this process's allocator.
    """
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    held_elsewhere = total - free - reserved   # CUDA context, other processes
    return int(total * gpu_memory_utilization - peak - held_elsewhere)


class KVCache:
    """The pools of one executor and the plan's cache operations on them."""

    def __init__(self, num_layers: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (num_layers, 2, num_gpu_blocks, block_size, num_kv_heads, head_dim)
        # NOTE: zero-filled, not torch.empty: padded slots of the CPU decode path are masked,
        # but a NaN bit pattern there would still poison softmax(..) @ V (0 * NaN = NaN).
        self.gpu = torch.zeros(shape, dtype=dtype, device=device)
        self.cpu = torch.zeros((num_layers, 2, num_cpu_blocks, *shape[3:]), dtype=dtype,
                               pin_memory=device.type == "cuda" and num_cpu_blocks > 0)
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size

    def swap_out(self, pairs: list[list[int]]) -> None:
        """[[gpu_block, cpu_block], ...]: copy each GPU block to its CPU block."""
        if pairs:
            ops.swap_blocks(self.gpu, self.cpu, self._pairs(pairs, self.num_gpu_blocks,
                                                            self.num_cpu_blocks, "swap_out"))

    def swap_in(self, pairs: list[list[int]]) -> None:
        """[[cpu_block, gpu_block], ...]: copy each CPU block back into the GPU pool."""
        if pairs:
            ops.swap_blocks(self.cpu, self.gpu, self._pairs(pairs, self.num_cpu_blocks,
                                                            self.num_gpu_blocks, "swap_in"))

    def copy(self, pairs: list[list[int]]) -> None:
        """[[src_gpu, dst_gpu], ...]: copy-on-write of whole blocks inside the GPU pool."""
        if pairs:
            t = self._pairs(pairs, self.num_gpu_blocks, self.num_gpu_blocks, "copy")
            ops.copy_blocks(self.gpu, t.to(self.gpu.device))

    @staticmethod
    def _pairs(pairs: list[list[int]], src_n: int, dst_n: int, what: str) -> torch.Tensor:
        t = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
        if t.numel() and (t[:, 0].min() < 0 or t[:, 0].max() >= src_n
                          or t[:, 1].min() < 0 or t[:, 1].max() >= dst_n):
            raise ValueError(f"{what}: block id out of range (source pool has {src_n} blocks, "
                             f"destination {dst_n}): {pairs}")
        return t
