"""Which packed fp32 GEMM runs the projections on this CPU, and how each is called.

Three candidates, each with its own packed weight layout, packed once at load:

    "engine"   the engine's own kernel (cpu_kernels.c): needs a C compiler and AVX-512,
               or AVX2 and FMA
    "mkl"      MKL's packed sgemm (torch.ops.mkl._mkl_linear)
    "onednn"   oneDNN's matmul (torch.ops.mkldnn._linear_pointwise)

A candidate is *available* when this torch build and CPU can run it, and *correct* when it
gives F.linear's result and gives each row the same bits whatever the number of rows (so a
sequence's logits, and a seeded draw from them, do not change when other sequences join or
leave the batch); only an available and correct one is ever used. Which correct one
is fastest depends on the CPU, so the executor times them on the model's own weights
(`pick_fp32_gemm`) at its first start on a machine and remembers the choice
(`remembered_fastest`); docs/executor.md reports them by row count
(loadtest/bench_cpu_gemm.py).

It also decides what `dtype="auto"` means on a CPU (`auto_cpu_dtype`).
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from services.executor import cpu_kernels

log = logging.getLogger(__name__)

FP32_GEMMS = ("engine", "mkl", "onednn")

# Bytes read between timed products so that the weight comes from memory, as in a decode
# step (which reads every weight of the model once): more than a core's share of a
# last-level cache, so that the ranking is the one of the real step (docs/executor.md).
EVICT_BYTES = 256 << 20


def pack_weight(gemm: str, w: torch.Tensor) -> torch.Tensor:
    """`w` packed once for one packed fp32 GEMM's calls."""
    if gemm == "engine":
        return cpu_kernels.pack_linear(w)
    if gemm == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(w, 1)
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


def packed_gemm(gemm: str, w: torch.Tensor, b: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """(packed weight, run) of one packed fp32 GEMM; run(x) = x W^T + b. (Linear.__call__
    in llama.py makes the same calls on its hot path, without the closure.)"""
    packed = pack_weight(gemm, w)
    if gemm == "engine":
        return packed, lambda x: cpu_kernels.linear(x, packed, w.shape[0], b)
    rows = min_rows(gemm, packed, w, b)
    if gemm == "mkl":
        return packed, lambda x: mkl_linear(x, packed, w, b, rows)
    return packed, lambda x: onednn_linear(x, packed, b, rows > 1)


def min_rows(gemm: str, packed: torch.Tensor, w: torch.Tensor,
             b: torch.Tensor | None = None) -> int:
    """Fewer rows than this run padded to it on this packed weight, so that a row gets the
    bits it gets in any batch: MKL's `mkl_min_rows`; oneDNN 2 where it runs a single row
    otherwise than two (`onednn_pads_one_row`), else 1; the engine's kernel 1."""
    if gemm == "mkl":
        return mkl_min_rows(packed, w, b)
    if gemm == "onednn":
        return 2 if onednn_pads_one_row(packed, w.shape[1], w.dtype, b) else 1
    return 1


# NOTE: MKL runs small row counts with other kernels than its blocked GEMM, and their sums
# round differently. Which counts depends on the CPU, the thread count and the weight's
# shape (docs/executor.md, "The CPU path"), so it is found once per weight, when packed:
# calls with fewer rows than its `mkl_min_rows` are padded to it.
MKL_MIN_ROWS = 16                       # the least padding: `gemm_correct` checks up to it
MKL_ROW_FLOORS = (16, 17, 24, 32, 64)   # the candidates, smallest first
_MKL_PROBE_ROWS = 128


def mkl_min_rows(packed: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> int:
    """The row count that fewer rows run padded to on this packed weight: the first of
    MKL_ROW_FLOORS whose product gives its rows the bits they get in a 128-row product
    (found with the torch threads of the caller, which the library splits the work over)."""
    x = torch.randn(_MKL_PROBE_ROWS, w.shape[1], generator=torch.Generator().manual_seed(0))
    full = torch.ops.mkl._mkl_linear(x, packed, w, b, _MKL_PROBE_ROWS)
    for rows in MKL_ROW_FLOORS:
        if torch.equal(torch.ops.mkl._mkl_linear(x[:rows], packed, w, b, rows), full[:rows]):
            return rows
    return _MKL_PROBE_ROWS


def mkl_linear(x: torch.Tensor, packed: torch.Tensor, w: torch.Tensor,
               b: torch.Tensor | None, min_rows: int = MKL_MIN_ROWS) -> torch.Tensor:
    """MKL's packed sgemm. MKL's packed B layout does not depend on M, so any row count may use
    a weight packed once. Fewer than `min_rows` rows (the weight's mkl_min_rows) run padded to
    it (the padding rows are zeros, dropped after): a decode step reads the whole weight
    anyway, so the extra rows cost little, and a row's result does not depend on how many
    rows it is multiplied with."""
    m = x.shape[0]
    if m < min_rows:
        padded = x.new_zeros(min_rows, x.shape[1])
        padded[:m] = x
        return torch.ops.mkl._mkl_linear(padded, packed, w, b, min_rows)[:m]
    return torch.ops.mkl._mkl_linear(x, packed, w, b, m)


def onednn_rows(m: int) -> int:
    """The row count oneDNN runs `m` rows as: m itself up to 16, else m rounded up to one of
    8 steps per power of two (at most 1/8 of padding rows)."""
    if m <= 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def onednn_pads_one_row(packed: torch.Tensor, k: int, dtype: torch.dtype,
                        b: torch.Tensor | None = None) -> bool:
    """Whether a single row must run padded to two on this packed weight (decided once, when
    the weight is packed).

    NOTE: oneDNN multiplies a single fp32 row with another kernel than two or more once the
    reduction is long (over 1,024 on an AMD EPYC Zen 4: SmolLM2's down projection, not its
    other projections), and the sums round differently; padded to two, the row gets the
    bits it gets in any batch. One row and two are multiplied here and compared."""
    probe = torch.randn(2, k, generator=torch.Generator().manual_seed(0)).to(dtype)
    two = torch.ops.mkldnn._linear_pointwise(probe, packed, b, "none", [], "")
    one = torch.ops.mkldnn._linear_pointwise(probe[:1], packed, b, "none", [], "")
    return not torch.equal(one, two[:1])


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None,
                  pad_one_row: bool = False) -> torch.Tensor:
    """oneDNN's matmul over a weight packed once, with the rows padded to onednn_rows (and a
    single row to two where `onednn_pads_one_row` said so for this weight).

    NOTE: oneDNN (and torch's ideep layer over it) builds and caches a primitive per input
    shape, milliseconds to build and memory kept in its caches (up to 1,024 shapes each).
    Unpadded, the row counts of a serving workload (every prompt length) would grow the
    executor's memory without bound and rebuild a primitive in most prefill steps; padded,
    a model's projections have at most 80 shapes per weight up to 4,096 rows (docs/soak.md
    measures the memory, docs/executor.md the speed)."""
    m = x.shape[0]
    r = 2 if m == 1 and pad_one_row else onednn_rows(m)
    if r != m:
        padded = x.new_zeros(r, x.shape[1])
        padded[:m] = x
        return torch.ops.mkldnn._linear_pointwise(padded, packed, b, "none", [], "")[:m]
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def _probe(gemm: str, k: int = 80) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, k, generator=g) / k ** 0.5, torch.randn(96, generator=g)
    return w, b, packed_gemm(gemm, w, b)[1]


def gemm_available(gemm: str) -> bool:
    """This torch build and CPU can run the GEMM (its library is there and a product runs)."""
    if gemm == "onednn" and not torch.backends.mkldnn.is_available():
        return False
    if gemm == "engine" and not cpu_kernels.linear_available():
        return False
    try:
        _, _, run = _probe(gemm)
        run(torch.ones(2, 80))
    except (AttributeError, RuntimeError):
        return False
    return True


def gemm_correct(gemm: str) -> bool:
    """The (available) GEMM gives F.linear's result, also for row counts other than the one
    it was packed for, and a row's result does not depend on how many rows are multiplied
    with it (batch invariance), over a short and a long reduction (a library may switch
    kernels with the length)."""
    for k in (80, 2048):
        w, b, run = _probe(gemm, k)
        x = torch.randn(300, k, generator=torch.Generator().manual_seed(1))
        full = run(x)
        if not (torch.allclose(full, F.linear(x, w, b), atol=1e-4, rtol=1e-5) and all(
                torch.equal(run(x[:m]), full[:m]) for m in (*range(1, MKL_MIN_ROWS + 1), 64))):
            return False
    return True


def usable_gemms() -> list[str]:
    """The GEMMs that are available here and correct. An available one that computes a wrong
    product is logged as an error and left out."""
    usable = []
    for gemm in FP32_GEMMS:
        if not gemm_available(gemm):
            continue
        if gemm_correct(gemm):
            usable.append(gemm)
        else:
            log.error("the packed fp32 %s GEMM gives wrong products on this machine: not used",
                      gemm)
    return usable


def pick_fp32_gemm(weights: list[torch.Tensor]) -> str | None:
    """The packed fp32 GEMM to use: "engine", "mkl", "onednn", or None (plain F.linear).

    PAGEDSERVE_CPU_GEMM=engine|mkl|onednn forces one (when it is usable here); by default
    the `fastest` on `weights` (the first layer's projections)."""
    usable = usable_gemms()
    forced = os.environ.get("PAGEDSERVE_CPU_GEMM", "auto")
    if forced in FP32_GEMMS:
        if forced in usable:
            return forced
        log.warning("PAGEDSERVE_CPU_GEMM=%s is not usable here; using %s", forced,
                    usable[0] if usable else "the plain GEMM")
    if len(usable) < 2:
        return usable[0] if usable else None
    return remembered_fastest(usable, weights, "fp32")


# The engine's GEMM is kept unless another times this much faster: closer than that, the
# timing at start does not tell them apart from one start to the next, while end to end the
# engine's saves what one product per size does not time (its epilogues' passes; oneDNN
# builds a primitive per new row count). Measured: docs/executor.md, "The CPU path".
ENGINE_MARGIN = 1.05


def fastest(gemms: list[str], weights: list[torch.Tensor], what: str) -> str:
    """The one of `gemms` with the lowest time per row summed over `weights` (the first
    layer's projections: which GEMM wins can change with the shape) and over two sizes, 64
    and 512 rows, those of decode and prefill steps, with each weight coming from memory,
    on this process's threads (about a second at start); the engine's within
    ENGINE_MARGIN of it."""
    evict = torch.ones(EVICT_BYTES // 4)
    cost = {g: sum(time_packed_gemm(g, w, evict) for w in weights) for g in gemms}
    del evict
    best = min(cost, key=cost.get)
    if "engine" in cost and cost["engine"] <= cost[best] * ENGINE_MARGIN:
        best = "engine"
    log.info("%s GEMM: %s (per row at 64 + at 512 rows, %d weights: %s)", what, best,
             len(weights), ", ".join(f"{g} {1e6 * c:.1f} us" for g, c in cost.items()))
    return best


def remembered_fastest(gemms: list[str], weights: list[torch.Tensor], what: str) -> str:
    """`fastest`, timed once per machine, weights' shapes and candidates and remembered
    (`cpu_kernels.remembered`, in $PAGEDSERVE_CACHE_DIR/gemm/): later starts read the choice
    instead of timing (1-2 s each)."""
    return cpu_kernels.remembered(
        "gemm", f"{what} GEMM", [[[list(w.shape), str(w.dtype)] for w in weights],
                                 ENGINE_MARGIN, EVICT_BYTES], gemms,
        lambda: fastest(gemms, weights, what))


def time_packed_gemm(gemm: str, w: torch.Tensor, evict: torch.Tensor) -> float:
    """Seconds per row of one product of 64 rows plus per row of one of 512 rows (medians
    of 3), each with the weight evicted from the caches first by reading `evict`: a decode
    row and a prefill row weigh the same, and the weight comes from memory as in a step."""
    _, run = packed_gemm(gemm, w)
    total = 0.0
    with torch.inference_mode():
        for m in (64, 512):
            x = torch.randn(m, w.shape[1], dtype=w.dtype)
            run(x)
            times = []
            for _ in range(3):
                evict.sum()
                t0 = time.perf_counter()
                run(x)
                times.append(time.perf_counter() - t0)
            total += statistics.median(times) / m
    return total


def bf16_gemm(weights: list[torch.Tensor] | None = None) -> str | None:
    """The packed GEMM of a bf16 model: "onednn" or "engine".

    Where the CPU multiplies bf16 itself (AMX, AVX-512 bf16) and torch packs bf16 for
    oneDNN: oneDNN, or, where the engine's GEMM also runs the CPU's bf16 dot products
    (AVX-512 bf16: AMD Zen 4 / Zen 5), the `fastest` of the two on `weights` (the first
    layer's projections).
    Else "engine", the engine's own GEMM over bf16 weights widened to fp32 in registers
    (AVX2 or AVX-512 without bf16: on a Zen 3 torch's plain bf16 GEMM gave 28.5 output
    tok/s against fp32's 164.7, loadtest/bench_llamacpp.py); else "onednn" where it packs
    bf16 anyway; else None (F.linear). PAGEDSERVE_CPU_GEMM=engine|onednn forces one where
    it is usable."""
    native = cpu_bf16()[1] is not None and bf16_packing()
    engine = cpu_kernels.linear_available()
    usable = [g for g, ok in (("onednn", native), ("engine", engine),
                              ("onednn", bf16_packing())) if ok]
    forced = os.environ.get("PAGEDSERVE_CPU_GEMM", "auto")
    if forced not in usable and native and engine and cpu_kernels.dp_available() and weights:
        return remembered_fastest(["engine", "onednn"], weights, "bf16")
    gemm = forced if forced in usable else usable[0] if usable else None
    log.info("bf16 GEMM: %s", gemm or "the plain GEMM")
    return gemm


def cpu_bf16() -> tuple[str, str | None]:
    """(vendor_id, "amx" | "avx512_bf16" | None) of this CPU from /proc/cpuinfo: whether it
    multiplies bf16 in hardware, with AMX tiles or with AVX-512 bf16 dot products."""
    vendor, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    vendor = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    isa = "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else None
    return vendor, isa


def bf16_packing() -> bool:
    """Whether this torch build packs bf16 weights for oneDNN here (it refuses on a CPU
    without AVX-512, whatever cpuinfo's bf16 flags are taken to be)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), None)
    except (AttributeError, RuntimeError):
        return False
    return True


def auto_cpu_dtype() -> torch.dtype:
    """What `dtype="auto"` runs on a CPU: bf16 where it is native and measured faster than
    fp32 end to end (docs/executor.md, loadtest/bench_executor.py), fp32 elsewhere:

      * AMX (Intel Sapphire Rapids and later): bf16 1.88x fp32 end to end;
      * AVX-512 bf16 without AMX on AMD (Zen 4, Zen 5): bf16 1.48x fp32 end to end on a Zen 4;
      * AVX-512 bf16 without AMX on Intel: oneDNN's bf16 GEMM runs at about half the fp32
        rate, so fp32; as on every CPU without bf16 instructions.

    bf16 also needs oneDNN's bf16 weight packing (this torch build), else fp32."""
    vendor, isa = cpu_bf16()
    fast = isa == "amx" or (isa == "avx512_bf16" and vendor == "AuthenticAMD")
    dtype = torch.bfloat16 if fast and bf16_packing() else torch.float32
    log.info("dtype auto on this CPU (%s, bf16 instructions: %s): %s", vendor or "unknown",
             isa or "none", str(dtype).removeprefix("torch."))
    return dtype
