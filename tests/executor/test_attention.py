"""The vectorised CPU paged attention against the kernels.reference oracle."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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


def _torch_decode(q, kc, vc, tables, lens, scale):
    """Plain torch: each sequence's blocks gathered in table order, fp32 softmax(q k^T) v."""
    bs, hkv = kc.shape[1], kc.shape[2]
    g = q.shape[1] // hkv
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        blocks = tables[b, :-(-n // bs)].long()
        k = kc[blocks].float().flatten(0, 1)[:n].repeat_interleave(g, dim=1)   # [n, Hq, D]
        v = vc[blocks].float().flatten(0, 1)[:n].repeat_interleave(g, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float() * scale, k), dim=-1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: no C kernels")
@pytest.mark.parametrize("cache_dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-5)])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (8, 2), (12, 1), (10, 2)])
@pytest.mark.parametrize("d", [64, 128, 80, 96, 32, 48, 20])
@pytest.mark.parametrize("bs", [16, 32, 4])
def test_c_decode_kernel_matches_torch(cache_dtype, tol, hq, hkv, d, bs):
    """The C kernel on its own over head sizes with a copy of their own (64, 128) and
    without (the generic loop, also for sizes that are no multiple of 16), GQA groups of 1
    to 12 (p . V takes up to 4 query heads at a time: groups of 5 and 12 end in a part),
    contexts shorter than a block and not a multiple of 16, blocks in shuffled order;
    bf16 caches are compared with the same bf16 values widened (the kernel computes in fp32
    either way)."""
    g = torch.Generator().manual_seed(d * 100 + hq * 10 + hkv + bs)
    lens = torch.tensor([1, 5, 16, 17, 33, 200, 47, 64], dtype=torch.int32)
    max_len, per_seq = int(lens.max()), -(-int(lens.max()) // bs)
    nb = len(lens) * per_seq + 3
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(cache_dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(cache_dtype)
    tables = torch.randperm(nb, generator=g)[:len(lens) * per_seq]
    tables = tables.view(len(lens), per_seq).to(torch.int32).contiguous()
    q = torch.randn(len(lens), hq, d, generator=g) * 2
    scale = d ** -0.5
    out = cpu_kernels.decode_attention(q, kc, vc, tables, lens, max_len, scale)
    ref = _torch_decode(q, kc, vc, tables, lens, scale)
    assert (out - ref).abs().max() < tol


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: no C kernels")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (10, 2), (12, 1), (8, 2)])
@pytest.mark.parametrize("d", [64, 128, 80])
@pytest.mark.parametrize("bs", [16, 4])
def test_c_decode_kernel_gives_the_same_bits_with_heads_together_or_one_at_a_time(
        cache_dtype, hq, hkv, d, bs):
    """The weighted sum of V takes up to heads_at_once query heads of a KV head at a time
    (the executor times 4 against 1 per CPU): each limit gives the very same output, bit
    for bit, over contexts of one to many blocks (the next block's prefetch spread over the
    tokens of each), and matches plain torch."""
    g = torch.Generator().manual_seed(d * 100 + hq * 10 + hkv + bs)
    lens = torch.tensor([1, 5, 16, 17, 33, 200, 47, 64], dtype=torch.int32)
    max_len, per_seq = int(lens.max()), -(-int(lens.max()) // bs)
    nb = len(lens) * per_seq
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(cache_dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(cache_dtype)
    tables = torch.randperm(nb, generator=g).view(len(lens), per_seq).to(torch.int32)
    q = torch.randn(len(lens), hq, d, generator=g)
    outs = {n: cpu_kernels.decode_attention(q, kc, vc, tables, lens, max_len, d ** -0.5,
                                            heads_at_once=n) for n in (4, 3, 2, 1)}
    for n in (3, 2, 1):
        assert torch.equal(outs[n], outs[4]), n
    ref = _torch_decode(q, kc, vc, tables, lens, d ** -0.5)
    assert (outs[1] - ref).abs().max() < 2e-5


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: no C kernels")
def test_c_decode_kernel_reads_qkv_rows_and_writes_into_out():
    """The query as the model passes it, a view of the QKV projection's rows (rows apart
    by (Hq + 2 Hkv) D), with `out` the first rows of the layer's output: the same values,
    bit for bit, as a contiguous copy of the query into a new tensor, and `out` is the
    tensor written (no copy)."""
    g = torch.Generator().manual_seed(7)
    hq, hkv, d, bs = 9, 3, 64, 16
    lens = torch.tensor([3, 40, 17], dtype=torch.int32)
    per_seq = -(-int(lens.max()) // bs)
    kc = torch.randn(len(lens) * per_seq, bs, hkv, d, generator=g)
    vc = torch.randn(len(lens) * per_seq, bs, hkv, d, generator=g)
    tables = torch.arange(len(lens) * per_seq, dtype=torch.int32).view(len(lens), per_seq)
    qkv = torch.randn(len(lens) + 2, (hq + 2 * hkv) * d, generator=g)
    q = qkv[:, :hq * d].view(-1, hq, d)[:len(lens)]
    assert not q.is_contiguous()
    scale = d ** -0.5
    out = torch.full((len(lens) + 2, hq, d), 7.0)
    got = cpu_kernels.decode_attention(q, kc, vc, tables, lens, int(lens.max()), scale,
                                       out=out[:len(lens)])
    assert got.data_ptr() == out.data_ptr()
    want = cpu_kernels.decode_attention(q.contiguous(), kc, vc, tables, lens, int(lens.max()),
                                        scale)
    assert torch.equal(out[:len(lens)], want)
    assert (out[len(lens):] == 7.0).all()              # rows past the decode rows untouched
    ref = _torch_decode(q, kc, vc, tables, lens, scale)
    assert (want - ref).abs().max() < 2e-5
    with pytest.raises(ValueError, match="contiguous fp32"):
        cpu_kernels.decode_attention(q, kc, vc, tables, lens, int(lens.max()), scale,
                                     out=torch.empty(len(lens), hq, d, dtype=torch.bfloat16))


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: no C kernels")
@pytest.mark.parametrize("dtype,rel,abs_", [(torch.float32, 0, 2e-5),
                                            (torch.bfloat16, 2 ** -8, 1e-5)])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (8, 2), (12, 1)])
@pytest.mark.parametrize("d", [64, 128, 80, 16])
@pytest.mark.parametrize("n", [1, 13, 14, 15, 29, 100, 301])
def test_c_prefill_kernel_matches_sdpa(dtype, rel, abs_, hq, hkv, d, n):
    """Causal attention of a chunk that starts at position 0, as the model passes it (the
    query, keys and values views of the QKV projection's rows), into rows of a larger
    output, against SDPA in float64 on the same values: chunks of one row, of one score
    tile (14 rows) and around it, GQA groups of 1 to 12, heads of one to eight vectors
    (80: a group of four and one of one). bf16: within one bf16 step of each value (the
    sums in fp32, rounded once)."""
    g = torch.Generator().manual_seed(n * 1000 + d * 10 + hq + hkv)
    qkv = (torch.randn(n, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype)
    q = qkv[:, :hq * d].view(n, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(n, hkv, d)
    out = torch.full((n + 2, hq, d), 7.0, dtype=dtype)
    scale = d ** -0.5
    assert cpu_kernels.prefill_attention(q, k, v, out[1:n + 1], scale)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.double().transpose(0, 1).unsqueeze(0) for t in (q, k, v)), is_causal=True,
        scale=scale, enable_gqa=True)[0].transpose(0, 1)
    assert ((out[1:n + 1].double() - ref).abs() <= ref.abs() * rel + abs_).all()
    assert (out[0] == 7.0).all() and (out[n + 1] == 7.0).all()    # other rows untouched


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: no C kernels")
def test_c_prefill_kernel_declines_what_it_does_not_take():
    """Head sizes that are no multiple of the vector width and mixed dtypes go back to the
    caller (False, nothing written), which runs SDPA; paged_attention's result is the same
    either way."""
    q, k, v = torch.randn(5, 4, 20), torch.randn(5, 2, 20), torch.randn(5, 2, 20)
    out = torch.full((5, 4, 20), 7.0)
    assert not cpu_kernels.prefill_attention(q, k, v, out, 0.2)
    assert not cpu_kernels.prefill_attention(q[..., :16].contiguous(), k[..., :16].contiguous(),
                                             v[..., :16].bfloat16(), out[..., :16].contiguous(),
                                             0.25)
    assert (out == 7.0).all()


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: no C kernels")
@pytest.mark.parametrize("dtype,cache_dtype,rel,abs_", [
    (torch.float32, torch.float32, 0, 2e-5), (torch.float32, torch.bfloat16, 0, 2e-5),
    (torch.bfloat16, torch.bfloat16, 2 ** -8, 1e-5)])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128), (12, 1, 16)])
@pytest.mark.parametrize("start,n", [(1, 1), (5, 14), (16, 29), (37, 3), (200, 15)])
@pytest.mark.parametrize("bs", [16, 4])
def test_c_prefill_kernel_over_the_pool_matches_sdpa(dtype, cache_dtype, rel, abs_, hq, hkv,
                                                     d, start, n, bs):
    """A chunk that continues a sequence (chunked prefill, a cached prefix): n query rows at
    positions start .. start + n - 1 over the keys of positions 0 .. start + n - 1, read
    from the pool through the sequence's blocks in shuffled order, against SDPA in float64
    on the same cache values (an fp32 model over a bf16 cache reads the rounded keys, as
    the SDPA path does)."""
    g = torch.Generator().manual_seed(start * 100 + n + d + bs)
    nk, nblocks = start + n, -(-(start + n) // bs)
    kc = torch.randn(nblocks + 5, bs, hkv, d, generator=g).to(cache_dtype)
    vc = torch.randn(nblocks + 5, bs, hkv, d, generator=g).to(cache_dtype)
    table = torch.randperm(nblocks + 5, generator=g)[:nblocks].to(torch.int32)
    qkv = (torch.randn(n, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype)
    q = qkv[:, :hq * d].view(n, hq, d)
    out = torch.full((n + 1, hq, d), 7.0, dtype=dtype)
    scale = d ** -0.5
    assert cpu_kernels.prefill_attention(q, kc, vc, out[:n], scale, table=table, start=start)
    k = kc[table.long()].reshape(-1, hkv, d)[:nk].double()
    v = vc[table.long()].reshape(-1, hkv, d)[:nk].double()
    mask = torch.arange(nk)[None, :] <= torch.arange(start, nk)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
        enable_gqa=True)[0].transpose(0, 1)
    assert ((out[:n].double() - ref).abs() <= ref.abs() * rel + abs_).all()
    assert (out[n] == 7.0).all()


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: no C kernels")
@pytest.mark.parametrize("paths", [(True, True), (False, False), (True, False), (False, True)])
def test_prefill_chunks_take_the_path_the_metadata_names(monkeypatch, paths):
    """meta.prefill_kernel = (fresh, continuing) sends those chunks to the C kernel and the
    others to SDPA, with the oracle's result either way."""
    chunks = [(9, 1), (0, 13), (17, 6), (0, 2), (40, 9)]
    q, k, v, kc, vc, meta = _batch(torch.float32, chunks)
    write_kv(k, v, kc, vc, meta)
    meta.prefill_kernel = paths
    called = []
    real = cpu_kernels.prefill_attention

    def spy(*args, table=None, **kw):
        called.append(table is not None)
        return real(*args, table=table, **kw)
    monkeypatch.setattr(cpu_kernels, "prefill_attention", spy)
    out = paged_attention(q, k, v, kc, vc, meta, D ** -0.5)
    assert called == [p for p in (False, True, False, True) if paths[p]]
    ref = reference.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, D ** -0.5)
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: no C kernels")
def test_the_faster_prefill_path_is_timed_once_and_remembered(monkeypatch, tmp_path):
    """pick_prefill_paths times the kernel against SDPA on chunks of the model's heads: a
    kernel slowed down loses to SDPA, an SDPA slowed down to the kernel; the choice is kept
    under PAGEDSERVE_CACHE_DIR and read back untimed; PAGEDSERVE_PREFILL_ATTENTION forces
    one."""
    import time

    from services.executor import attention

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDSERVE_PREFILL_ATTENTION", raising=False)
    real_kernel, real_sdpa = cpu_kernels.prefill_attention, F.scaled_dot_product_attention
    slow = {"kernel": False, "sdpa": True}

    def kernel(*a, **kw):
        if slow["kernel"]:
            time.sleep(0.004)
        return real_kernel(*a, **kw)

    def sdpa(*a, **kw):
        if slow["sdpa"]:
            time.sleep(0.004)
        return real_sdpa(*a, **kw)
    monkeypatch.setattr(cpu_kernels, "prefill_attention", kernel)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
    shape = (4, 2, 16, torch.float32, torch.float32, 4)
    assert attention.pick_prefill_paths(*shape) == (True, True)
    slow.update(kernel=True, sdpa=False)
    assert attention.pick_prefill_paths(*shape) == (True, True)           # remembered
    assert attention.pick_prefill_paths(4, 2, 32, *shape[3:]) == (False, False)  # other heads
    timed = []
    monkeypatch.setattr(attention, "_faster_prefill", lambda *a: timed.append(a) or "sdpa")
    assert attention.pick_prefill_paths(*shape) == (True, True) and not timed
    for kept in (tmp_path / "attention").iterdir():
        kept.write_text("{not json")
    assert attention.pick_prefill_paths(*shape) == (False, False) and len(timed) == 2
    monkeypatch.setenv("PAGEDSERVE_PREFILL_ATTENTION", "kernel")
    assert attention.pick_prefill_paths(*shape) == (True, True)
    monkeypatch.setenv("PAGEDSERVE_PREFILL_ATTENTION", "sdpa")
    assert attention.pick_prefill_paths(*shape) == (False, False)


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: no C kernels")
def test_the_decode_kernels_heads_at_once_are_timed_once_and_remembered(monkeypatch, tmp_path):
    """pick_decode_heads times the decode kernel with the query heads of a KV head
    together and one at a time, over pools of the model's heads: the slower one loses;
    the choice is kept under PAGEDSERVE_CACHE_DIR and read back untimed, an unreadable
    file is timed again, and a model without grouped heads has nothing to time."""
    import time

    from services.executor import attention

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(attention, "DECODE_TIMING_BYTES", 1 << 20)     # a quick timing
    monkeypatch.setattr(attention, "DECODE_TIMING_ROUNDS", 2)
    real, slow, calls = cpu_kernels.decode_attention, {"n": 1}, []

    def kernel(*a, heads_at_once, **kw):
        calls.append(heads_at_once)
        if heads_at_once == slow["n"]:
            time.sleep(0.002)
        return real(*a, heads_at_once=heads_at_once, **kw)
    monkeypatch.setattr(cpu_kernels, "decode_attention", kernel)
    shape = (4, 2, 16, torch.float32, 4)
    assert attention.pick_decode_heads(*shape) == cpu_kernels.HEADS_AT_ONCE
    assert set(calls) == {1, cpu_kernels.HEADS_AT_ONCE}
    slow["n"] = cpu_kernels.HEADS_AT_ONCE
    calls.clear()
    assert attention.pick_decode_heads(*shape) == cpu_kernels.HEADS_AT_ONCE   # remembered
    assert not calls
    assert attention.pick_decode_heads(4, 2, 16, torch.bfloat16, 4) == 1     # another pool
    for kept in (tmp_path / "attention").iterdir():
        kept.write_text("{not json")
    assert attention.pick_decode_heads(*shape) == 1 and calls
    calls.clear()
    assert attention.pick_decode_heads(4, 4, 16, torch.float32, 4) == cpu_kernels.HEADS_AT_ONCE
    assert not calls                                   # one query head per KV head


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: no C kernels")
def test_the_prefill_scratch_is_kept_up_to_a_size_and_a_longer_one_given_back(monkeypatch):
    """A chunk's scratch (its context's keys and values in fp32) stays for the next calls
    while it is at most PREFILL_SCRATCH_KEEP_BYTES; a longer context's is used for its call
    only, with the same result."""
    monkeypatch.setattr(cpu_kernels, "_prefill_scratch", torch.empty(0))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(40, h, 64, generator=g) for h in (4, 2, 2))
    scale = 64 ** -0.5
    out = torch.empty_like(q)
    assert cpu_kernels.prefill_attention(q[:8], k[:8], v[:8], out[:8], scale)
    kept = cpu_kernels._prefill_scratch
    assert kept.numel() > 0
    assert cpu_kernels.prefill_attention(q[:4], k[:4], v[:4], out[:4], scale)
    assert cpu_kernels._prefill_scratch is kept                   # reused, not grown
    monkeypatch.setattr(cpu_kernels, "PREFILL_SCRATCH_KEEP_BYTES", kept.numel() * 4)
    assert cpu_kernels.prefill_attention(q, k, v, out, scale)     # needs more than kept
    assert cpu_kernels._prefill_scratch is kept
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale,
        enable_gqa=True).transpose(0, 1)
    assert (out - ref).abs().max() < 1e-5
