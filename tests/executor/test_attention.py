"""The vectorised CPU paged attention against the kernels.reference oracle."""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from services.executor import cpu_kernels
from services.executor.attention import AttentionMetadata, paged_attention, write_kv

BS, HQ, HKV, D, NB = 4, 6, 2, 16, 1024


def _batch(dtype, chunks, seed=0):
    """chunks: (num_computed, num_tokens) per seq; the leading one-token rows are the decode
    batch. Blocks are scattered."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NB, BS, HKV, D, generator=g).to(dtype)
    v_cache = torch.randn(NB, BS, HKV, D, generator=g).to(dtype)
    perm = torch.randperm(NB, generator=g).tolist()
    tables = []
    for c, n in chunks:
        need = -(-(c + n) // BS)
        tables.append([perm.pop() for _ in range(need)])
    meta = AttentionMetadata.build(tables, [c for c, _ in chunks], [n for _, n in chunks], BS,
                                   torch.device("cpu"))
    t = sum(n for _, n in chunks)
    q = torch.randn(t, HQ, D, generator=g).to(dtype)
    k = torch.randn(t, HKV, D, generator=g).to(dtype)
    v = torch.randn(t, HKV, D, generator=g).to(dtype)
    return q, k, v, k_cache, v_cache, meta


@pytest.fixture(params=["c", "torch"])
def decode_path(request, monkeypatch):
    """Both CPU decode paths: the C kernel, and the gather + SDPA fallback."""
    if request.param == "c":
        assert cpu_kernels.kernels() is not None, "the C kernels must build here"
    else:
        monkeypatch.setattr(cpu_kernels, "_lib", None)
    return request.param


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_attention_matches_reference_on_mixed_batch(dtype, tol, decode_path):
    # three decodes at different lengths, a fresh prompt, a continuing chunk, one more fresh
    chunks = [(9, 1), (0, 1), (30, 1), (0, 13), (17, 6), (0, 2)]
    q, k, v, kc, vc, meta = _batch(dtype, chunks)
    ref_k, ref_v = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, meta)
    reference.write_kv(k, v, ref_k, ref_v, meta.slot_mapping)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    out = paged_attention(q, k, v, kc, vc, meta, D ** -0.5)
    ref = reference.paged_attention(q, ref_k, ref_v, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, D ** -0.5)
    assert (out.float() - ref.float()).abs().max() < tol


def test_decode_ignores_stale_slots_past_the_context(decode_path):
    chunks = [(5, 1), (2, 1)]
    q, k, v, kc, vc, meta = _batch(torch.float32, chunks, seed=1)
    write_kv(k, v, kc, vc, meta)
    before = paged_attention(q, k, v, kc, vc, meta, 0.25)
    # Garbage in the unused tail of each last block (and in other blocks) must not leak in.
    bt = meta.block_tables.tolist()
    used = {bt[b][p // BS] * BS + p % BS for b, (c, n) in enumerate(chunks) for p in range(c + n)}
    for b, (c, n) in enumerate(chunks):
        for pos in range(c + n, meta.block_tables.shape[1] * BS):
            blk = int(meta.block_tables[b, pos // BS])
            if blk * BS + pos % BS not in used:
                kc[blk, pos % BS] = 1e4
    assert torch.allclose(paged_attention(q, k, v, kc, vc, meta, 0.25), before)


def test_a_one_token_row_after_a_chunk_runs_as_a_chunk_of_one(decode_path):
    """Only the leading one-token rows form the decode batch; a one-token prefill chunk
    placed after a longer chunk (the plan's non-sampling rows come last) is exact too."""
    chunks = [(9, 1), (0, 7), (12, 1), (0, 1), (3, 5)]
    q, k, v, kc, vc, meta = _batch(torch.float32, chunks, seed=5)
    assert meta.num_decode == 1 and len(meta.prefills) == 4
    write_kv(k, v, kc, vc, meta)
    out = paged_attention(q, k, v, kc, vc, meta, 0.3)
    ref = reference.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, 0.3)
    assert (out - ref).abs().max() < 1e-5


def test_large_decode_batch_matches_reference(decode_path):
    lens = torch.randint(1, 120, (48,), generator=torch.Generator().manual_seed(3))
    chunks = [(int(c), 1) for c in lens]
    q, k, v, kc, vc, meta = _batch(torch.float32, chunks, seed=4)
    write_kv(k, v, kc, vc, meta)
    out = paged_attention(q, k, v, kc, vc, meta, 0.3)
    ref = reference.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, 0.3)
    assert (out - ref).abs().max() < 1e-5
