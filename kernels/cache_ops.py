"""KV cache operations in Triton: write_kv, copy_blocks (copy-on-write), swap_blocks.

Layouts are those of `kernels.reference`. A block, for one layer and one of K/V, is one
contiguous run of block_size * Hkv * D elements, so moving blocks is moving runs:

    kv_cache [L, 2, num_blocks, block_size, Hkv, D]
              │  │  └ block id ─▶ run of BLOCK_NUMEL = block_size * Hkv * D elements
              │  └ K / V
              └ layer                  one program per (block pair, layer x K/V, chunk of run)

swap_blocks crosses the host/GPU boundary, which a Triton program cannot: the GPU side
runs a Triton kernel that gathers (swap out) or scatters (swap in) the blocks through a
contiguous staging buffer, the buffer crosses in one DMA through pinned memory, and the
CPU side gathers or scatters with torch (a CPU pool is plain host memory):

    swap out:  GPU pool ─[Triton gather]▶ staging ─[DMA]▶ pinned host ─[index_copy_]▶ CPU pool
    swap in:   CPU pool ─[index_select]▶ pinned host ─[DMA]▶ staging ─[Triton scatter]▶ GPU pool

Under TRITON_INTERPRET=1 (tests without a GPU) both sides are CPU tensors and both the
gather and the scatter run as Triton kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.interpreter_compat import cast, interpreting

CHUNK = 1024  # elements one program moves (2 KiB in bf16); a block run is a few chunks


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    NUM_HEADS: tl.constexpr, HEADS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    INTERPRET: tl.constexpr,            # see kernels.interpreter_compat
):
    """One program per new token: its Hkv x D keys and values go to cache slot slot_mapping[t]."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:                    # -1: a padding token, nothing to store
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    head = tl.arange(0, HEADS_P2)[:, None]
    dim = tl.arange(0, HEAD_DIM_P2)[None, :]
    mask = (head < NUM_HEADS) & (dim < HEAD_DIM)
    t = token.to(tl.int64)
    k = tl.load(key_ptr + t * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + head * stride_vh + dim, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kct + head * stride_kch + dim,
             cast(k, k_cache_ptr.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vct + head * stride_vch + dim,
             cast(v, v_cache_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _move_blocks_kernel(
    src_ptr, dst_ptr, src_index_ptr, dst_index_ptr,
    src_stride_layer, src_stride_kv, src_stride_block,
    dst_stride_layer, dst_stride_kv, dst_stride_block,
    BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
):
    """dst[layer, kv, dst_index[p]] := src[layer, kv, src_index[p]], one chunk per program.

    Copy (both indices from the pair list), gather (dst_index = 0..P-1 into a staging
    buffer) and scatter (src_index = 0..P-1 out of one) are all this one kernel.
    """
    pair = tl.program_id(0)
    layer = tl.program_id(1) // 2
    kv = tl.program_id(1) % 2
    chunk = tl.program_id(2)
    src_block = tl.load(src_index_ptr + pair).to(tl.int64)
    dst_block = tl.load(dst_index_ptr + pair).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    src = (src_ptr + layer.to(tl.int64) * src_stride_layer + kv * src_stride_kv
           + src_block * src_stride_block)
    dst = (dst_ptr + layer.to(tl.int64) * dst_stride_layer + kv * dst_stride_kv
           + dst_block * dst_stride_block)
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def _runs_triton(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can touch t: a GPU tensor, or any tensor under the interpreter."""
    return t.is_cuda or interpreting()


def _check_pool(cache: torch.Tensor, name: str) -> None:
    if cache.dim() != 6:
        raise ValueError(f"{name} must be [layers, 2, num_blocks, block_size, Hkv, D], "
                         f"got shape {tuple(cache.shape)}")
    numel = cache.shape[3] * cache.shape[4] * cache.shape[5]
    if not cache[0, 0, 0].is_contiguous() or cache.stride(2) < numel:
        raise ValueError(f"{name}: each block must be one contiguous run (allocate the pool "
                         f"with torch.empty, not as a strided view)")


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value [T, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D]
    at slot_mapping [T] (slot = block * block_size + offset; -1 = skip)."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous head dimension")
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEADS_P2=triton.next_power_of_2(num_heads),
        HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], INTERPRET=interpreting(), num_warps=4,
    )


def _move_blocks(src: torch.Tensor, dst: torch.Tensor, src_index: torch.Tensor,
                 dst_index: torch.Tensor) -> None:
    """dst[:, :, dst_index[p]] := src[:, :, src_index[p]] on one device, by the Triton kernel."""
    num_pairs = src_index.shape[0]
    block_numel = src.shape[3] * src.shape[4] * src.shape[5]
    grid = (num_pairs, src.shape[0] * 2, triton.cdiv(block_numel, CHUNK))
    _move_blocks_kernel[grid](
        src, dst, src_index, dst_index,
        src.stride(0), src.stride(1), src.stride(2),
        dst.stride(0), dst.stride(1), dst.stride(2),
        BLOCK_NUMEL=block_numel, CHUNK=CHUNK, num_warps=4,
    )


def copy_blocks(kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy-on-write: for each [src, dst] row of pairs [P, 2], block dst := block src in
    every layer, K and V. The dst blocks must be distinct and not among the srcs (fresh
    blocks, as copy-on-write allocates them): the copies run in parallel."""
    if pairs.numel() == 0:
        return
    _check_pool(kv_cache, "kv_cache")
    pairs = pairs.to(device=kv_cache.device, dtype=torch.int64)
    _move_blocks(kv_cache, kv_cache, pairs[:, 0].contiguous(), pairs[:, 1].contiguous())


def _gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache[:, :, index] as a new contiguous [L, 2, P, block_size, Hkv, D] tensor."""
    if not _runs_triton(cache):
        out = torch.empty((cache.shape[0], cache.shape[1], index.shape[0], *cache.shape[3:]),
                          dtype=cache.dtype, pin_memory=torch.cuda.is_available())
        return torch.index_select(cache, 2, index, out=out)
    out = torch.empty((cache.shape[0], cache.shape[1], index.shape[0], *cache.shape[3:]),
                      dtype=cache.dtype, device=cache.device)
    _move_blocks(cache, out, index, torch.arange(index.shape[0], device=cache.device))
    return out


def _scatter(cache: torch.Tensor, index: torch.Tensor, staging: torch.Tensor) -> None:
    """cache[:, :, index] := staging ([L, 2, P, block_size, Hkv, D], on cache's device)."""
    if not _runs_triton(cache):
        cache.index_copy_(2, index, staging)
        return
    _move_blocks(staging, cache, torch.arange(index.shape[0], device=cache.device), index)


def _to_device(staging: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One DMA of the whole staging buffer; returns once the data is usable on `device`."""
    if staging.device == device:
        return staging
    if device.type == "cpu":
        # NOTE: a non-blocking device-to-host copy lands in pinned memory (full DMA speed);
        # the CPU scatter that follows reads it, so wait for this copy (and only it).
        host = staging.to(device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(staging.device))
        done.synchronize()
        return host
    # Host to GPU from pinned memory, ordered on the current stream before the scatter;
    # torch's pinned allocator keeps the host buffer alive until the copy has finished.
    return staging.to(device, non_blocking=staging.is_pinned())


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Move blocks between pools: dst_cache[:, :, d] := src_cache[:, :, s] for each [s, d]
    row of pairs [P, 2]. Pools are [L, 2, num_blocks, block_size, Hkv, D], same dtype; one
    is usually the GPU pool and the other the CPU swap pool. Returns when dst is written
    (a CPU dst) or when the writes are queued on the current stream (a GPU dst)."""
    if pairs.numel() == 0:
        return
    _check_pool(src_cache, "src_cache")
    _check_pool(dst_cache, "dst_cache")
    if src_cache.shape[0:2] != dst_cache.shape[0:2] or src_cache.shape[3:] != dst_cache.shape[3:]:
        raise ValueError(f"pools disagree on block shape: {tuple(src_cache.shape)} vs "
                         f"{tuple(dst_cache.shape)}")
    if src_cache.dtype != dst_cache.dtype:
        raise ValueError(f"pools disagree on dtype: {src_cache.dtype} vs {dst_cache.dtype}")
    pairs = pairs.to(torch.int64)
    src_index = pairs[:, 0].to(src_cache.device).contiguous()
    dst_index = pairs[:, 1].to(dst_cache.device).contiguous()
    staging = _gather(src_cache, src_index)
    _scatter(dst_cache, dst_index, _to_device(staging, dst_cache.device))
