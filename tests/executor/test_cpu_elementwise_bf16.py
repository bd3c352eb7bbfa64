"""The bf16 versions of the fused elementwise C kernels (cpu_kernels.c) against the torch
ops they replace (services/executor/llama.py), on the same bf16 inputs.

Both round to bf16 at the same points, so nearly every value has the same bits; where the
fp32 values before rounding differ in their last bit (summation order, exp), a rounded value
may be one bf16 step apart, and a product of it two steps."""
from __future__ import annotations

import pytest
import torch

from services.executor import cpu_kernels
from services.executor.llama import _apply_rope, _rms_norm

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None,
                                reason="no C compiler: the torch ops path runs instead")


def _steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps separate each pair of values (same sign assumed where close)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _assert_same_rounding(got: torch.Tensor, want: torch.Tensor, steps: int = 1) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    apart = _steps_apart(got, want)
    assert int(apart.max()) <= steps, f"{int(apart.max())} bf16 steps apart"
    assert float((apart == 0).float().mean()) > 0.97      # nearly all identical


@pytest.mark.parametrize("with_h", [True, False])
def test_add_rms_norm_bf16_matches_the_torch_ops(with_h):
    g = torch.Generator().manual_seed(1)
    t, hidden, eps = 37, 576, 1e-5
    residual = torch.randn(t, hidden, generator=g).mul(3).bfloat16()
    h = torch.randn(t, hidden, generator=g).bfloat16() if with_h else None
    w = torch.randn(hidden, generator=g).bfloat16()
    ref_res = residual.clone()
    if h is not None:
        ref_res.add_(h)
    want = _rms_norm(ref_res, w, eps)
    got_res = residual.clone()
    got = cpu_kernels.add_rms_norm(got_res, h, w, eps)
    assert torch.equal(got_res, ref_res)            # the residual add: one rounding, exact
    _assert_same_rounding(got, want)


def test_silu_and_mul_bf16_matches_the_torch_ops():
    g = torch.Generator().manual_seed(2)
    gu = torch.randn(19, 2 * 1536, generator=g).mul(4).bfloat16()
    inter = gu.shape[1] // 2
    want = torch.nn.functional.silu(gu[:, :inter].clone()).mul_(gu[:, inter:])
    # silu(gate) one step apart (an exp differing in its last fp32 bit near a tie) makes
    # its product with `up` up to two steps apart
    _assert_same_rounding(cpu_kernels.silu_and_mul(gu), want, steps=2)


def test_rope_and_cache_bf16_matches_the_torch_ops():
    g = torch.Generator().manual_seed(3)
    t, hq, hkv, d, bs, max_len = 23, 9, 3, 64, 16, 512
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).bfloat16()
    positions = torch.randint(0, max_len, (t,), generator=g)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32),
                        torch.rand(d // 2, generator=g))
    cos, sin = freqs.cos().bfloat16(), freqs.sin().bfloat16()
    slots = torch.randperm(8 * bs, generator=g)[:t]
    slots[5] = -1                                   # a padding row: not stored
    # the torch ops path: rotate, then index_copy_ into the caches
    want = qkv.clone()
    qk = want[:, :(hq + hkv) * d].view(t, -1, d)
    _apply_rope(qk, cos.index_select(0, positions).unsqueeze(1),
                sin.index_select(0, positions).unsqueeze(1), d // 2)
    got = qkv.clone()
    k_cache = torch.zeros(8, bs, hkv, d, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    cpu_kernels.rope_and_cache(got, positions, cos, sin, slots, k_cache, v_cache, hq, hkv)
    assert torch.equal(got, want)                   # products and sums round as torch's do
    keep = slots >= 0
    k_flat, v_flat = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    assert torch.equal(k_flat[slots[keep]], want[keep, hq * d:(hq + hkv) * d].view(-1, hkv, d))
    assert torch.equal(v_flat[slots[keep]], want[keep, (hq + hkv) * d:].view(-1, hkv, d))
    stored = torch.zeros(8 * bs, dtype=torch.bool)
    stored[slots[keep]] = True
    assert not k_flat[~stored].any() and not v_flat[~stored].any()


def test_rope_and_cache_rounds_fp32_rows_into_a_bf16_cache():
    """An fp32 model with a bf16 KV cache: the rows rotate in fp32 as they do with an fp32
    cache, and the cache holds those K/V rounded to nearest even, as torch's cast does."""
    g = torch.Generator().manual_seed(3)
    t, hq, hkv, d, bs, max_len = 19, 6, 2, 64, 16, 256
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    positions = torch.randint(0, max_len, (t,), generator=g)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32),
                        torch.rand(d // 2, generator=g))
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.randperm(8 * bs, generator=g)[:t]
    slots[4] = -1
    rows32, rows16 = qkv.clone(), qkv.clone()
    k32 = torch.zeros(8, bs, hkv, d)
    v32 = torch.zeros_like(k32)
    k16, v16 = k32.bfloat16(), v32.bfloat16()
    cpu_kernels.rope_and_cache(rows32, positions, cos, sin, slots, k32, v32, hq, hkv)
    cpu_kernels.rope_and_cache(rows16, positions, cos, sin, slots, k16, v16, hq, hkv)
    assert torch.equal(rows16, rows32)
    assert k32.any() and torch.equal(k16, k32.bfloat16()) and torch.equal(v16, v32.bfloat16())
    with pytest.raises(TypeError, match="bfloat16 rows in a torch.float32 cache"):
        cpu_kernels.rope_and_cache(qkv.bfloat16(), positions, cos.bfloat16(), sin.bfloat16(),
                                   slots, k32, v32, hq, hkv)
