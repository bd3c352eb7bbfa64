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
