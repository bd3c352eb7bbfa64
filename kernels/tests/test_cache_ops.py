"""The Triton cache operations equal their torch references, element for element.

Every destination starts as a sentinel, and the whole pool is compared after the call, so
a slot the kernel forgot keeps the sentinel (and fails), and a slot it should not have
touched but did differs from the reference (and fails).
"""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.cache_ops import copy_blocks, swap_blocks, write_kv
from kernels.tests.paged_batch import DEVICE

SENTINEL = -7777.0


def _pool(layers: int, num_blocks: int, block_size: int, heads: int, head_dim: int,
          dtype: torch.dtype, device: str = DEVICE, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, 2, num_blocks, block_size, heads, head_dim)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


WRITE_CASES = {
    # id: (tokens, Hkv, D, block_size, num_blocks, key dtype, cache dtype)
    "fp32-h3-d64-bs8": (13, 3, 64, 8, 6, torch.float32, torch.float32),
    "bf16-h2-d128-bs32": (9, 2, 128, 32, 3, torch.bfloat16, torch.bfloat16),
    "fp32-into-bf16-h1-d64-bs16": (7, 1, 64, 16, 2, torch.float32, torch.bfloat16),
}


@pytest.mark.parametrize("case", list(WRITE_CASES), ids=list(WRITE_CASES))
def test_write_kv_stores_each_token_at_its_slot_and_skips_minus_one(case):
    tokens, heads, head_dim, block_size, num_blocks, key_dtype, cache_dtype = WRITE_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    # key and value as views into one fused qkv projection: token rows are strided
    fused = torch.randn((tokens, 3 * heads, head_dim), generator=gen).to(DEVICE, key_dtype)
    key, value = fused[:, heads:2 * heads], fused[:, 2 * heads:]
    # distinct slots anywhere in the pool, the very last slot included; every 4th skipped
    slots = torch.randperm(num_blocks * block_size - 1, generator=gen)[:tokens]
    slots[0] = num_blocks * block_size - 1
    slots[1::4] = -1
    slots = slots.to(DEVICE)
    pool = torch.full((1, 2, num_blocks, block_size, heads, head_dim), SENTINEL,
                      dtype=cache_dtype, device=DEVICE)
    expected = pool.clone()
    reference.write_kv(key, value, expected[0, 0], expected[0, 1], slots)
    write_kv(key, value, pool[0, 0], pool[0, 1], slots)
    assert torch.equal(pool, expected)    # a dtype conversion rounds as torch does, too
    assert (pool == SENTINEL).sum() == (expected == SENTINEL).sum()


def test_write_kv_of_no_tokens_leaves_the_cache_alone():
    pool = _pool(1, 2, 8, 1, 64, torch.float32)
    before = pool.clone()
    empty = torch.empty((0, 1, 64), device=DEVICE)
    write_kv(empty, empty, pool[0, 0], pool[0, 1], torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(pool, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_copy_blocks_copies_whole_blocks_in_every_layer(dtype):
    pool = _pool(3, 9, 16, 2, 64, dtype)
    pool[:, :, 5:] = SENTINEL              # the fresh copy-on-write targets
    # block 1 forked twice (parallel sampling), block 4 once
    pairs = torch.tensor([[1, 5], [1, 6], [4, 8]], dtype=torch.int64, device=DEVICE)
    expected = pool.clone()
    reference.copy_blocks(expected, pairs)
    copy_blocks(pool, pairs)
    assert torch.equal(pool, expected)
    assert torch.equal(pool[:, :, 6], pool[:, :, 1])


def test_copy_blocks_with_no_pairs_changes_nothing():
    pool = _pool(2, 4, 8, 1, 64, torch.float32)
    before = pool.clone()
    copy_blocks(pool, torch.empty((0, 2), dtype=torch.int64, device=DEVICE))
    assert torch.equal(pool, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swap_out_then_swap_in_restores_the_blocks(dtype):
    gpu = _pool(2, 8, 8, 2, 64, dtype, seed=1)                   # on the GPU when there is one
    cpu = torch.full((2, 2, 6, 8, 2, 64), SENTINEL, dtype=dtype)  # the CPU swap pool
    out_pairs = torch.tensor([[7, 0], [2, 5], [3, 1]], dtype=torch.int64)  # gpu -> cpu
    expected_cpu = cpu.clone()
    reference.swap_blocks(gpu, expected_cpu, out_pairs)
    swap_blocks(gpu, cpu, out_pairs)
    assert torch.equal(cpu, expected_cpu)

    saved = gpu[:, :, [7, 2, 3]].clone()
    gpu[:, :, :] = SENTINEL                                          # blocks reused meanwhile
    in_pairs = torch.tensor([[0, 4], [5, 0], [1, 6]], dtype=torch.int64)   # cpu -> gpu
    expected_gpu = gpu.clone()
    reference.swap_blocks(cpu, expected_gpu, in_pairs)
    swap_blocks(cpu, gpu, in_pairs)
    assert torch.equal(gpu, expected_gpu)
    assert torch.equal(gpu[:, :, [4, 0, 6]], saved)


def test_swap_with_no_pairs_changes_nothing():
    gpu = _pool(1, 3, 8, 1, 64, torch.float32)
    cpu = _pool(1, 3, 8, 1, 64, torch.float32, device="cpu", seed=2)
    before = (gpu.clone(), cpu.clone())
    swap_blocks(gpu, cpu, torch.empty((0, 2), dtype=torch.int64))
    swap_blocks(cpu, gpu, torch.empty((0, 2), dtype=torch.int64))
    assert torch.equal(gpu, before[0]) and torch.equal(cpu, before[1])


def test_swap_between_pools_of_different_block_shape_is_refused():
    gpu = _pool(1, 3, 8, 1, 64, torch.float32)
    cpu = _pool(1, 3, 16, 1, 64, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="block shape"):
        swap_blocks(gpu, cpu, torch.tensor([[0, 0]]))
