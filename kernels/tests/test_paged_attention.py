"""The Triton PagedAttention kernel equals the torch reference.

Without a GPU this runs under TRITON_INTERPRET=1 (set by the repo's conftest.py): exact
but slow, so each case is one small mixed batch, and the cases together cover every axis
(GQA 1/3/8, head dim 64/128, block size 8/16/32, fp32/bf16/fp16, context 1 / exact block
multiples / ragged, prefill chunks with prior context mixed with decodes, split and
unsplit context) instead of their product. On a GPU the same tests run compiled.
"""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.paged_attention import paged_attention, plan_launch
from kernels.tests.paged_batch import make_batch

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def exact_attention(batch) -> torch.Tensor:
    """The reference on the same values in fp32, not rounded to bf16/fp16 at the end: the
    kernel's error is then its own (one output rounding, P rounded for the P @ V product)."""
    query, k_cache, v_cache, *rest = batch.args()
    return reference.paged_attention(query.float(), k_cache.float(), v_cache.float(), *rest)

# (context_len, q_len) per sequence: q_len 1 is a decode, q_len == context_len a first
# prefill chunk, 1 < q_len < context_len a later chunk attending to its cached prefix.
CASES = {
    # id: (seqs, num_kv_heads, group, head_dim, block_size, dtype, num_splits)
    "fp32-gqa1-d64-bs8-mixed": (
        [(1, 1), (16, 1), (21, 5), (11, 11), (70, 1)], 2, 1, 64, 8, torch.float32, None),
    "bf16-gqa3-d64-bs16-mixed": (
        [(32, 1), (45, 7), (1, 1), (70, 20), (10, 0)], 1, 3, 64, 16, torch.bfloat16, None),
    "fp16-gqa8-d128-bs32-mixed": (
        [(64, 1), (33, 1), (100, 9), (5, 5)], 1, 8, 128, 32, torch.float16, None),
    "fp32-gqa8-d128-bs16-decodes": (
        [(1, 1), (48, 1), (77, 1), (130, 1)], 1, 8, 128, 16, torch.float32, None),
    "bf16-gqa3-d128-bs32-decodes": (
        [(96, 1), (1, 1), (65, 1)], 2, 3, 128, 32, torch.bfloat16, None),
    "fp32-gqa3-d64-bs8-split4-mixed": (
        [(200, 1), (150, 1), (190, 12), (1, 1)], 1, 3, 64, 8, torch.float32, 4),
    "bf16-gqa8-d128-bs16-split4-decodes": (
        [(450, 1), (64, 1), (2, 1)], 1, 8, 128, 16, torch.bfloat16, 4),
    "fp32-gqa1-d128-bs32-split2-prefill": (
        [(130, 130), (97, 40)], 1, 1, 128, 32, torch.float32, 2),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_paged_attention_matches_reference(case):
    seqs, hkv, group, head_dim, block_size, dtype, num_splits = CASES[case]
    batch = make_batch(seqs, num_kv_heads=hkv, group=group, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, seed=list(CASES).index(case),
                       strided_query="mixed" in case)
    if num_splits is not None:   # rounding to whole tiles must not merge the splits away
        plan = plan_launch(batch.query.shape[0], len(seqs), group, block_size,
                           batch.block_tables.shape[1], hkv, batch.query.device, num_splits)
        assert plan.num_splits == num_splits
    expected = exact_attention(batch)
    out = torch.full_like(batch.query, float("nan"))   # a row the kernel skips stays NaN
    got = paged_attention(*batch.args(), num_splits=num_splits, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert got.dtype == dtype
    err = (got.float() - expected.float()).abs().max().item()
    print(f"{case}: max abs error {err:.1e}")     # docs/kernels.md's table (pytest -s)
    assert err < TOLERANCE[dtype], f"max abs error {err}"


def test_decode_only_batch_uses_one_token_tiles():
    plan = plan_launch(num_tokens=64, num_seqs=64, group=4, block_size=16, max_blocks_per_seq=8,
                       num_kv_heads=8, device=torch.device("cpu"))
    assert (plan.block_m, plan.block_q) == (16, 4)
    assert plan.num_tiles >= 64    # every decode gets its own tile


def test_mismatched_heads_are_refused_with_a_clear_error():
    batch = make_batch([(4, 1)], num_kv_heads=2, group=2, head_dim=64, block_size=8,
                       dtype=torch.float32)
    query = batch.query[:, :3]      # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention(query, *batch.args()[1:])


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches_match_reference(seed):
    # Shapes drawn from the same axes as CASES, in combinations nobody hand-picked.
    gen = torch.Generator().manual_seed(1000 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    block_size, group, head_dim = pick([8, 16, 32]), pick([1, 3, 8]), pick([64, 128])
    dtype = [torch.float32, torch.bfloat16][seed % 2]
    seqs = []
    for _ in range(int(torch.randint(1, 6, (1,), generator=gen))):
        ctx = int(torch.randint(1, 150, (1,), generator=gen))
        q_len = pick([1, 1, ctx, int(torch.randint(1, ctx + 1, (1,), generator=gen))])
        seqs.append((ctx, q_len))
    batch = make_batch(seqs, num_kv_heads=pick([1, 2]), group=group, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, seed=seed)
    expected = exact_attention(batch)
    out = torch.full_like(batch.query, float("nan"))
    paged_attention(*batch.args(), num_splits=pick([None, 2, 3]), out=out)
    err = (out.float() - expected.float()).abs().max().item()
    assert err < TOLERANCE[dtype], f"{seqs} bs={block_size} group={group} D={head_dim}: {err}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with ~10 GB free")
def test_blocks_past_2_31_elements_are_addressed_exactly():
    # int64 offsets: block ids whose element offset exceeds 2^31 in a [nb, 16, 8, 128] pool.
    from kernels.cache_ops import copy_blocks, write_kv
    block_size, heads, head_dim = 16, 8, 128
    num_blocks = (1 << 31) // (block_size * heads * head_dim) + 64
    kv_cache = torch.zeros((1, 2, num_blocks, block_size, heads, head_dim),
                           dtype=torch.bfloat16, device="cuda")
    ctx = 40 * block_size
    high = torch.arange(num_blocks - 40, num_blocks, device="cuda", dtype=torch.int32)
    slots = (high.long()[:, None] * block_size + torch.arange(block_size, device="cuda")).flatten()
    key = torch.randn((ctx, heads, head_dim), device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    write_kv(key, value, kv_cache[0, 0], kv_cache[0, 1], slots)
    assert torch.equal(kv_cache[0, 0].flatten(0, 1)[slots], key)
    query = torch.randn((3, heads * 4, head_dim), device="cuda", dtype=torch.bfloat16)
    args = (query, kv_cache[0, 0], kv_cache[0, 1], high[None, :], torch.tensor(
        [ctx], device="cuda", dtype=torch.int32), torch.tensor([0, 3], device="cuda",
        dtype=torch.int32), head_dim ** -0.5)
    expected = reference.paged_attention(*args)
    err = (paged_attention(*args).float() - expected.float()).abs().max().item()
    assert err < TOLERANCE[torch.bfloat16]
    copy_blocks(kv_cache, torch.tensor([[num_blocks - 1, 0], [num_blocks - 40, 1]], device="cuda"))
    assert torch.equal(kv_cache[:, :, 0], kv_cache[:, :, num_blocks - 1])
    assert torch.equal(kv_cache[:, :, 1], kv_cache[:, :, num_blocks - 40])
