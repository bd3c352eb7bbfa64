"""What `dtype="auto"` runs on a CPU: bf16 where the CPU multiplies bf16 natively and bf16
measured faster (AMX; AVX-512 bf16 on AMD), fp32 elsewhere; an explicit dtype always wins."""
from __future__ import annotations

import pytest
import torch

from services.executor import cpu_gemm
from tests.executor.conftest import tiny_runner

CPUS = [  # (vendor, bf16 instructions, what auto runs)
    ("GenuineIntel", "amx", torch.bfloat16),            # Sapphire Rapids and later
    ("AuthenticAMD", "avx512_bf16", torch.bfloat16),    # Zen 4 / Zen 5
    ("GenuineIntel", "avx512_bf16", torch.float32),     # Cooper Lake: bf16 GEMM at half rate
    ("AuthenticAMD", None, torch.float32),
    ("GenuineIntel", None, torch.float32),
]


@pytest.mark.parametrize("vendor,isa,expected", CPUS)
def test_auto_follows_the_cpu(monkeypatch, vendor, isa, expected):
    monkeypatch.setattr(cpu_gemm, "cpu_bf16", lambda: (vendor, isa))
    if expected == torch.bfloat16 and not cpu_gemm.bf16_packing():
        expected = torch.float32      # this machine cannot pack bf16 (no AVX-512)
    assert cpu_gemm.auto_cpu_dtype() == expected


def test_auto_without_the_bf16_packing_is_fp32(monkeypatch):
    def no_bf16(*_):
        raise RuntimeError("no bf16 reorder")
    monkeypatch.setattr(cpu_gemm, "cpu_bf16", lambda: ("GenuineIntel", "amx"))
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", no_bf16)
    assert cpu_gemm.auto_cpu_dtype() == torch.float32


def test_cpu_bf16_reads_this_machine():
    vendor, isa = cpu_gemm.cpu_bf16()
    with open("/proc/cpuinfo") as f:
        lines = f.read().splitlines()
    flags = next(ln for ln in lines if ln.startswith("flags")).split(":", 1)[1].split()
    assert vendor == next(ln for ln in lines if ln.startswith("vendor_id")).split(":")[1].strip()
    assert isa == ("amx" if "amx_bf16" in flags else
                   "avx512_bf16" if "avx512_bf16" in flags else None)


@pytest.mark.parametrize("vendor,isa,expected", [CPUS[0], CPUS[2]])
def test_runner_auto_and_explicit(monkeypatch, tiny_llama, vendor, isa, expected):
    folder, _ = tiny_llama
    monkeypatch.setattr(cpu_gemm, "cpu_bf16", lambda: (vendor, isa))
    if not cpu_gemm.bf16_packing():
        expected = torch.float32
    auto = tiny_runner(folder, dtype="auto")
    assert auto.dtype == expected and auto.kv.gpu.dtype == expected
    assert tiny_runner(folder, dtype="float32").dtype == torch.float32


def test_onednn_runs_a_bounded_set_of_row_counts_with_little_padding():
    # oneDNN keeps a primitive per input shape: every row count a workload brings would
    # grow the executor's memory (cpu_gemm.onednn_linear).
    rows = [cpu_gemm.onednn_rows(m) for m in range(1, 4097)]
    assert len(set(rows)) <= 80
    assert all(m <= r <= m + m / 8 for m, r in zip(range(1, 4097), rows))
    assert rows[:16] == list(range(1, 17))


@pytest.mark.skipif(not cpu_gemm.bf16_packing(), reason="this torch build does not pack bf16 "
                    "weights for oneDNN on this CPU")
def test_padded_onednn_rows_give_the_unpadded_product():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(960, 576, generator=g).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    for m in (1, 16, 17, 33, 130, 1000):
        x = torch.randn(m, 576, generator=g).bfloat16()
        out = cpu_gemm.onednn_linear(x, packed, None)
        assert out.shape == (m, 960) and out.is_contiguous()
        ref = torch.nn.functional.linear(x.float(), w.float())
        assert (out.float() - ref).abs().max() <= 0.02 * ref.abs().max(), m
