"""The packed fp32 GEMM of cpu_kernels.c against F.linear, on the shapes its tiling has to
get right: N not a multiple of the column panel (32 columns with AVX-512, 16 with AVX2),
row counts around the row tile (14 rows, 6) and past the ~1 MiB row block, strided rows of x, bias or none, one thread or two."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from services.executor import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.linear_available(),
                                reason="the packed fp32 GEMM needs a C compiler and AVX-512 or AVX2")


@pytest.mark.parametrize("n,k", [(1, 1), (17, 3), (33, 80), (40, 100), (96, 576),
                                 (100, 1536), (3072, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_everywhere_it_writes(n, k, bias):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = cpu_kernels.pack_linear(w)
    nr = cpu_kernels.gemm_nr()
    assert nr in (16, 32) and packed.numel() == -(-n // nr) * nr * k
    # 300 rows at K=1536 span two row blocks; 5/6/7 and 13/14/15 straddle a tile
    for m in (1, 5, 6, 7, 13, 14, 15, 64, 300):
        x = torch.randn(m, k + 7, generator=g)[:, :k]     # rows k + 7 floats apart
        out = torch.full((m, n), float("nan"))            # a column never written stays NaN
        cpu_kernels.linear(x, packed, n, b, out=out)
        ref = F.linear(x, w, b)
        assert torch.isfinite(out).all(), (m, n, k)
        assert (out - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item()), (m, n, k)


@pytest.mark.parametrize("threads", [1, 2])
def test_linear_is_the_same_on_any_number_of_threads(threads):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(960, 576, generator=g), torch.randn(64, 576, generator=g)
    packed = cpu_kernels.pack_linear(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = cpu_kernels.linear(x, packed, 960)
    finally:
        torch.set_num_threads(before)
    # each output element is one dot product in a fixed order, whatever the thread split
    assert torch.equal(got, cpu_kernels.linear(x, packed, 960))
    assert (got - F.linear(x, w)).abs().max() < 1e-4


@pytest.mark.parametrize("inter,k", [(1, 5), (16, 64), (40, 80), (1536, 576)])
def test_swiglu_epilogue_is_silu_of_gate_times_up(inter, k):
    """A [gate | up] weight packed with glu=True gives silu(x Wg^T) * (x Wu^T), and writes
    exactly the `inter` columns of each row (a poisoned output shows any other)."""
    g = torch.Generator().manual_seed(inter + k)
    w = torch.randn(2 * inter, k, generator=g) / k ** 0.5
    packed = cpu_kernels.pack_linear(w, glu=True)
    for m in (1, 14, 29, 64):
        x = torch.randn(m, k, generator=g)
        out = torch.full((m, inter), float("nan"))
        cpu_kernels.linear(x, packed, 2 * inter, out=out, glu=True)
        gate_up = F.linear(x, w)
        ref = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        assert torch.isfinite(out).all()
        assert (out - ref).abs().max() < 1e-5 * max(1.0, ref.abs().max().item()), (m, inter, k)


def test_accumulate_adds_the_product_into_out():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(100, 48, generator=g), torch.randn(100, generator=g)
    x, residual = torch.randn(30, 48, generator=g), torch.randn(30, 100, generator=g)
    out = residual.clone()
    cpu_kernels.linear(x, cpu_kernels.pack_linear(w), 100, b, out=out, accumulate=True)
    # the product is rounded first, then added: bit for bit what F.linear then add_ give
    assert torch.equal(out, residual + cpu_kernels.linear(x, cpu_kernels.pack_linear(w), 100, b))
    assert (out - (residual + F.linear(x, w, b))).abs().max() < 1e-4


def bf16_forms():
    """The engine's two bf16 GEMMs: weights widened to fp32 (any CPU with the engine's
    GEMM), and bf16 dot products of k-pairs (dp, where the CPU has AVX-512 bf16)."""
    return [False, pytest.param(True, marks=pytest.mark.skipif(
        not cpu_kernels.dp_available(), reason="no AVX-512 bf16 dot products here"))]


@pytest.mark.parametrize("form", ["fp32", "bf16", "dp"])
def test_panels_a_busy_thread_has_not_reached_are_done_by_another_with_the_same_bits(form):
    """More threads than cores: threads lose their core in the middle of a product, and
    the others take over the panels they have not claimed yet. Whoever does a panel, the
    product is the same bits as one thread's, and every column is written."""
    if form == "dp" and not cpu_kernels.dp_available():
        pytest.skip("no AVX-512 bf16 dot products here")
    g = torch.Generator().manual_seed(7)
    n, k = 4096 + 17, 576
    w = torch.randn(n, k, generator=g) / k ** 0.5
    x = torch.randn(64, k, generator=g)
    if form != "fp32":
        w, x = w.bfloat16(), x.bfloat16()
    packed = cpu_kernels.pack_linear(w, dp=form == "dp")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_kernels.linear(x, packed, n)
        torch.set_num_threads(max(8, 4 * (os.cpu_count() or 1)))
        start = cpu_kernels.panels_taken_over()
        for _ in range(200):
            out = torch.full((64, n), float("nan"), dtype=x.dtype)
            cpu_kernels.linear(x, packed, n, out=out)
            assert torch.equal(out, alone)
            if cpu_kernels.panels_taken_over() > start:
                break
    finally:
        torch.set_num_threads(before)
    assert cpu_kernels.panels_taken_over() > start, "no thread ever took over a panel"


@pytest.mark.parametrize("dp", bf16_forms())
@pytest.mark.parametrize("n,k", [(17, 3), (24, 45), (100, 1536), (3072, 576)])
def test_bf16_weights_give_the_fp32_product_rounded_once(n, k, dp):
    """bf16 x and W, fp32 sums, one rounding to bf16 at the end: within one bf16 step of the
    exact product, every column written (a poisoned output shows any other), and each row
    gets the same bits alone as in any batch. k = 3: an odd k, whose last pair the dp
    form pads with a zero; k = 45: the tile copy's squares and then single values."""
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    packed = cpu_kernels.pack_linear(w, dp=dp)
    assert packed.dtype == (torch.int32 if dp else torch.bfloat16)
    for m in (1, 5, 6, 7, 14, 64, 300):
        x = torch.randn(m, k + 3, generator=g).bfloat16()[:, :k]
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        cpu_kernels.linear(x, packed, n, b, out=out)
        exact = F.linear(x.double(), w.double(), b.double())
        assert torch.isfinite(out.float()).all()
        # fp32 sums, then one rounding: at most one bf16 step (2^-8 relative) off
        err = (out.double() - exact).abs()
        assert (err <= exact.abs() * 2 ** -8 + 1e-5 * k ** 0.5).all(), (m, n, k)
        for r in (1, 2, 5, 13):
            if r <= m:
                assert torch.equal(cpu_kernels.linear(x[:r], packed, n, b), out[:r])


@pytest.mark.parametrize("dp", bf16_forms())
def test_bf16_epilogues_round_where_torch_rounds(dp):
    """accumulate: residual + the rounded product, rounded (F.linear then add_ in bf16);
    glu: silu and the product over the rounded gate and up halves, as torch's bf16 ops."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(2 * 40, 80, generator=g) / 9).bfloat16()
    x = torch.randn(29, 80, generator=g).bfloat16()
    product = cpu_kernels.linear(x, cpu_kernels.pack_linear(w, dp=dp), 80)
    residual = torch.randn(29, 80, generator=g).bfloat16()
    out = residual.clone()
    cpu_kernels.linear(x, cpu_kernels.pack_linear(w, dp=dp), 80, out=out, accumulate=True)
    assert torch.equal(out, residual + product)
    glu = cpu_kernels.linear(x, cpu_kernels.pack_linear(w, glu=True, dp=dp), 80, glu=True)
    assert torch.equal(glu, F.silu(product[:, :40]) * product[:, 40:])


def test_bad_arguments_are_refused():
    packed = cpu_kernels.pack_linear(torch.randn(8, 4), glu=True)
    with pytest.raises(ValueError, match="no bias"):
        cpu_kernels.linear(torch.randn(2, 4), packed, 8, torch.zeros(8), glu=True)
    with pytest.raises(ValueError, match="missing"):
        cpu_kernels.linear(torch.randn(2, 4), packed, 8, accumulate=True)
    with pytest.raises(ValueError, match="even"):
        cpu_kernels.pack_linear(torch.randn(7, 4), glu=True)
    with pytest.raises(TypeError, match="fp32"):
        cpu_kernels.linear(torch.randn(2, 4, dtype=torch.bfloat16), packed, 8, glu=True)


def test_a_gemm_that_computes_wrong_products_is_never_picked(monkeypatch, caplog):
    """Available and correct are told apart: a GEMM that runs but is wrong is left out (and
    logged), even when PAGEDSERVE_CPU_GEMM asks for it."""
    from services.executor import cpu_gemm

    real = cpu_gemm.packed_gemm

    def off_by_one(gemm, w, b=None):
        packed, run = real(gemm, w, b)
        return packed, lambda x: run(x) + 1.0

    monkeypatch.setattr(cpu_gemm, "packed_gemm", off_by_one)
    assert cpu_gemm.gemm_available("engine") and not cpu_gemm.gemm_correct("engine")
    assert cpu_gemm.usable_gemms() == []
    monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", "engine")
    assert cpu_gemm.pick_fp32_gemm([torch.randn(64, 32)]) is None
    assert "gives wrong products" in caplog.text


def test_a_gemm_whose_rows_depend_on_the_row_count_is_not_correct(monkeypatch):
    """Batch invariance is part of correctness: a GEMM that rounds one row differently when it
    is alone (within F.linear's tolerance) is left out, since a seeded draw could then flip
    when the batch shrinks."""
    from services.executor import cpu_gemm

    real = cpu_gemm.packed_gemm

    def gemv_rounds_otherwise(gemm, w, b=None):
        packed, run = real(gemm, w, b)
        return packed, lambda x: run(x) * (1 + 1e-7) if x.shape[0] == 1 else run(x)

    monkeypatch.setattr(cpu_gemm, "packed_gemm", gemv_rounds_otherwise)
    assert not cpu_gemm.gemm_correct("engine")


@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536)], ids=["up", "down"])
@pytest.mark.parametrize("gemm", ["engine", "mkl", "onednn"])
def test_every_packed_gemm_gives_a_row_the_same_bits_alone_and_in_a_batch(gemm, shape):
    """Through the executor's own Linear, on SmolLM2's up and down projections (where MKL's
    small-row kernels, up to 16 rows over the down projection's 1,536-long reduction on an
    Intel Xeon, and oneDNN's one-row kernel over that reduction round otherwise than their
    GEMMs): row i of a product of M rows is bit-identical for every M,
    so a sequence's logits do not depend on who else is in the step."""
    from services.executor import cpu_gemm
    from services.executor.llama import Linear

    if not cpu_gemm.gemm_available(gemm):
        pytest.skip(f"{gemm} is not available in this torch build / CPU")
    g = torch.Generator().manual_seed(3)
    lin = Linear(torch.randn(*shape, generator=g) / shape[1] ** 0.5)
    lin.set_packed(cpu_gemm.pack_weight(gemm, lin.weight), gemm)
    x = torch.randn(64, shape[1], generator=g)
    full = lin(x)
    for m in (1, 2, 3, 17, 63):
        assert torch.equal(lin(x[:m]), full[:m]), f"{gemm}: rows differ at M={m}"
