"""Build, load and call the C kernels of the CPU path (cpu_kernels.c) through ctypes.

The shared library is compiled once per (source, flags, CPU) into
$PAGEDSERVE_CACHE_DIR/kernels/ and reused by later processes (about a second of gcc).
Without a working C compiler, or with PAGEDSERVE_CPU_KERNELS=torch, `kernels()` returns
None and callers keep their torch code path; the results agree either way (tests check
both).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import subprocess
from pathlib import Path
from typing import Callable, Sequence

import torch

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("cpu_kernels.c")
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-strict-aliasing", "-fopenmp", "-fPIC"]
# NOTE: linked in a second step without -ffast-math: linking with it adds crtfastmath.o,
# which turns on flush-to-zero and denormals-are-zero for the whole process when the
# library loads (torch's own results, and anything else in the process, would change).
_LDFLAGS = ["-shared", "-fopenmp"]
_lib: ctypes.CDLL | None | bool = False          # False: not tried yet; None: unavailable


def kernels() -> ctypes.CDLL | None:
    """The loaded library, or None when disabled or not buildable here (logged once)."""
    global _lib
    if _lib is False:
        _lib = None
        if os.environ.get("PAGEDSERVE_CPU_KERNELS", "c") != "torch":
            try:
                _lib = _load()
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("CPU kernels unavailable (%s); using torch ops instead", exc)
    return _lib


def build_key() -> str:
    """What the library is built from: its source, the compiler flags and the CPU (the
    flags of /proc/cpuinfo; -march=native code must not run on another CPU)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = next((ln for ln in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
                  if ln.startswith("flags")), "")
    return hashlib.sha256(_SRC.read_bytes() + " ".join(_CFLAGS + _LDFLAGS).encode()
                          + flags.encode()
                          + platform.machine().encode()).hexdigest()[:16]


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))


def remembered(folder: str, what: str, key: list, choices: Sequence[str],
               decide: Callable[[], str]) -> str:
    """decide() -- one of `choices`, timed on this machine -- run once and remembered: kept in
    $PAGEDSERVE_CACHE_DIR/<folder>/<what>-<hash>.json, the hash made of `key` (what is timed:
    shapes, dtypes, candidates) and of what runs it (the thread count, the CPU's model and
    flags, torch's version, this library's build), so later starts read it instead of
    timing and make the same choice (the candidates round differently: a start must not
    change a greedy output). A file that is unreadable or names no current choice is timed
    again. Delete the folder to time everything again."""
    cpu = []
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith(("model name", "flags")):
                    cpu.append(ln.strip())
                    if len(cpu) == 2:
                        break
    except OSError:
        pass
    build = build_key() if kernels() is not None else "none"
    digest = hashlib.sha256(json.dumps(
        [what, list(choices), key, torch.get_num_threads(), torch.__version__, cpu, build],
        default=str).encode()).hexdigest()[:24]
    path = cache_root() / folder / f"{what.replace(' ', '-')}-{digest}.json"
    try:
        best = json.loads(path.read_text())["choice"]
        if best in choices:
            log.info("%s: %s (timed at an earlier start: %s)", what, best, path)
            return best
    except (OSError, ValueError, KeyError, TypeError):
        pass                                 # not timed yet here, or an unreadable file
    best = decide()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"choice": best}))
        os.replace(tmp, path)                # atomic: a concurrent start reads all or nothing
    except OSError as exc:
        log.warning("could not keep the %s choice in %s: %s", what, path, exc)
    return best


def _load() -> ctypes.CDLL:
    path = cache_root() / "kernels" / f"cpu_kernels-{build_key()}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        obj = tmp.with_suffix(".o")
        cc = os.environ.get("CC", "gcc")
        try:
            subprocess.run([cc, *_CFLAGS, "-c", str(_SRC), "-o", str(obj)],
                           check=True, capture_output=True, timeout=120)
            subprocess.run([cc, *_LDFLAGS, str(obj), "-o", str(tmp), "-lm"],
                           check=True, capture_output=True, timeout=120)
        finally:
            obj.unlink(missing_ok=True)
        os.replace(tmp, path)    # atomic: concurrent first starts never load a partial file
    # NOTE: torch's libgomp is already loaded under the same soname, so these kernels run
    # on torch's OpenMP thread pool rather than a second one competing for the cores.
    lib = ctypes.CDLL(str(path))
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.paged_decode_attention.argtypes = [p, p, p, i32, p, i64, p, p, i64, i64, i64, i64, i64,
                                           p, i64, i32, f32, i64, i32]
    lib.paged_decode_attention.restype = i32
    lib.add_rms_norm.argtypes = [p, p, p, p, i64, i64, f32, i32]
    lib.add_rms_norm.restype = None
    lib.silu_and_mul.argtypes = [p, p, i64, i64, i32]
    lib.silu_and_mul.restype = None
    lib.rope_and_cache.argtypes = [p, i64, p, p, p, p, p, p, i32, i64, i64, i64, i64, i32]
    lib.rope_and_cache.restype = None
    lib.add_rms_norm_bf16.argtypes = lib.add_rms_norm.argtypes
    lib.add_rms_norm_bf16.restype = None
    lib.silu_and_mul_bf16.argtypes = lib.silu_and_mul.argtypes
    lib.silu_and_mul_bf16.restype = None
    lib.rope_and_cache_bf16.argtypes = [p, i64, p, p, p, p, p, p, i64, i64, i64, i64, i32]
    lib.rope_and_cache_bf16.restype = None
    lib.prefill_scratch_floats.argtypes = [i64, i64, i64, i32]
    lib.prefill_scratch_floats.restype = i64
    lib.prefill_attention.argtypes = [p, i64, i32, p, p, i64, i32, p, i64, i64, p, i64, i64,
                                      i64, i64, i64, f32, p, i32]
    lib.prefill_attention.restype = i32
    lib.greedy_logprobs.argtypes = [p, i64, i64, i64, p, p, i32]
    lib.greedy_logprobs.restype = None
    lib.linear_packed_available.argtypes = []
    lib.linear_packed_available.restype = i32
    lib.linear_packed_nr.argtypes = []
    lib.linear_packed_nr.restype = i32
    lib.pack_linear_weight.argtypes = [p, i64, i64, i32, p, i32]
    lib.pack_linear_weight.restype = None
    lib.linear_packed.argtypes = [p, i64, i64, i64, p, i64, p, p, i64, i32, i32]
    lib.linear_packed.restype = i32
    lib.pack_linear_weight_bf16.argtypes = lib.pack_linear_weight.argtypes
    lib.pack_linear_weight_bf16.restype = None
    lib.linear_packed_bf16.argtypes = lib.linear_packed.argtypes
    lib.linear_packed_bf16.restype = i32
    lib.linear_packed_dp_available.argtypes = []
    lib.linear_packed_dp_available.restype = i32
    lib.pack_linear_weight_dp.argtypes = lib.pack_linear_weight.argtypes
    lib.pack_linear_weight_dp.restype = None
    lib.linear_packed_dp.argtypes = lib.linear_packed.argtypes
    lib.linear_packed_dp.restype = i32
    lib.gemm_panels_taken_over.argtypes = []
    lib.gemm_panels_taken_over.restype = i64
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# The most query heads the decode kernel's weighted sum of V takes at once (its ATT_GH).
HEADS_AT_ONCE = 4


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: torch.Tensor, lens: torch.Tensor, max_len: int,
                     scale: float, out: torch.Tensor | None = None,
                     heads_at_once: int = HEADS_AT_ONCE) -> torch.Tensor:
    """Attention of one query row per sequence over its paged context: [B, Hq, D] fp32.

    tables [B, max_blocks] int32 contiguous, lens [B] int32; caches fp32 or bf16. out: an
    fp32 contiguous [B, Hq, D] to write into (else a new tensor). heads_at_once: at most
    this many query heads of a KV head share each read of V (the kernel takes fewer where
    their sums do not fit its registers; 1: one head at a time); the output is the same."""
    if k_cache.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the CPU decode kernel reads fp32 or bf16 caches, not {k_cache.dtype}")
    nd, hq, d = query.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    q = query.float()
    if q.stride(2) != 1 or q.stride(1) != d:   # (rows apart are read as they are)
        q = q.contiguous()
    if out is None:
        out = torch.empty(nd, hq, d, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.shape != (nd, hq, d) or not out.is_contiguous():
        raise ValueError("out must be a contiguous fp32 [B, Hq, D]")
    threads = torch.get_num_threads()
    scratch = torch.empty(threads * hq * max_len, dtype=torch.float32)
    rc = kernels().paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16),
        tables.data_ptr(), tables.shape[1], lens.data_ptr(), out.data_ptr(), nd, hq, hkv, d, bs,
        scratch.data_ptr(), max_len, threads, scale, q.stride(0), heads_at_once)
    if rc != 0:
        raise ValueError(f"{hq} heads of {d} exceed the CPU decode kernel (at most 256 heads "
                         "and 16384 floats per token): set PAGEDSERVE_CPU_KERNELS=torch")
    return out


_prefill_scratch = torch.empty(0)
# The scratch is kept between calls up to this size (no page faults per layer); a longer
# context's (8 KV heads of 128 at 32k tokens: 270 MB) is allocated for its call and given
# back, so that one long prompt does not hold it for the life of the process.
PREFILL_SCRATCH_KEEP_BYTES = 64 << 20


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      out: torch.Tensor, scale: float, table: torch.Tensor | None = None,
                      start: int = 0) -> bool:
    """Causal attention of a chunk of n tokens at positions start .. start + n - 1, into out.

    query [n, Hq, D] (rows any distance apart, heads contiguous), out [n, Hq, D] (contiguous
    rows), both fp32 or both bf16. Without `table`: key/value [n, Hkv, D] are the chunk's
    own (start 0), views like the query, in its dtype. With `table` (int32, the chunk's
    blocks in order): key/value are the pools [blocks, block_size, Hkv, D], fp32 or bf16,
    holding positions 0 .. start + n - 1. False where the kernel does not take these (the
    caller runs SDPA)."""
    global _prefill_scratch
    lib = kernels()
    n, hq, d = query.shape
    hkv = key.shape[-2]
    paged = table is not None
    if (lib is None or query.dtype not in (torch.float32, torch.bfloat16)
            or out.dtype != query.dtype or key.dtype != value.dtype
            or key.dtype not in (torch.float32, torch.bfloat16)
            or (not paged and key.dtype != query.dtype)
            or any(t.stride(-1) != 1 or t.stride(-2) != d for t in (query, key, value, out))
            or out.stride(0) != hq * d or key.stride(0) != value.stride(0)
            or (paged and not (key.is_contiguous() and value.is_contiguous()
                               and table.dtype == torch.int32 and table.is_contiguous()
                               and table.numel() * key.shape[1] >= start + n))):
        return False
    threads = torch.get_num_threads()
    need = lib.prefill_scratch_floats(start + n, hkv, d, threads)
    if need <= 0:
        return False
    scratch = _prefill_scratch
    if scratch.numel() < need:
        scratch = torch.empty(need, dtype=torch.float32)
        if need * 4 <= PREFILL_SCRATCH_KEEP_BYTES:
            _prefill_scratch = scratch
    return lib.prefill_attention(
        query.data_ptr(), query.stride(0), int(query.dtype == torch.bfloat16), key.data_ptr(),
        value.data_ptr(), hkv * d if paged else key.stride(0),
        int(key.dtype == torch.bfloat16), table.data_ptr() if paged else None,
        key.shape[1] if paged else 0, start, out.data_ptr(), out.stride(0), n, hq, hkv, d,
        scale, scratch.data_ptr(), threads) == 0


def add_rms_norm(residual: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """residual += h (in place, unless h is None); returns rms_norm(residual) * weight.
    fp32 or bf16 rows (every tensor of one call in the same dtype)."""
    out = torch.empty_like(residual)
    t, hidden = residual.shape
    lib = kernels()
    fn = lib.add_rms_norm_bf16 if residual.dtype == torch.bfloat16 else lib.add_rms_norm
    fn(residual.data_ptr(), _ptr(h), weight.data_ptr(), out.data_ptr(), t, hidden, eps,
       torch.get_num_threads())
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    lib = kernels()
    fn = lib.silu_and_mul_bf16 if gate_up.dtype == torch.bfloat16 else lib.silu_and_mul
    fn(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, torch.get_num_threads())
    return out


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
    """Rotate the q and k heads of qkv [T, (Hq + 2 Hkv) D] in place; store k, v at slots.
    The caches hold the rows' dtype, or bf16 for fp32 rows (rounded to nearest even)."""
    t, d = qkv.shape[0], k_cache.shape[-1]
    lib = kernels()
    args = (qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())
    rest = (t, num_heads, num_kv_heads, d, torch.get_num_threads())
    if qkv.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16:
        lib.rope_and_cache_bf16(*args, *rest)
    elif qkv.dtype == torch.float32 and k_cache.dtype in (torch.float32, torch.bfloat16):
        lib.rope_and_cache(*args, int(k_cache.dtype == torch.bfloat16), *rest)
    else:
        raise TypeError(f"no CPU kernel stores {qkv.dtype} rows in a {k_cache.dtype} cache")


EPI_STORE, EPI_ADD, EPI_GLU = 0, 1, 2


def linear_available() -> bool:
    """True when the packed GEMM (fp32, and bf16 weights with fp32 sums) was built (it
    needs AVX-512, or AVX2 and FMA)."""
    lib = kernels()
    return lib is not None and bool(lib.linear_packed_available())


def dp_available() -> bool:
    """True where the packed GEMM also multiplies bf16 with the CPU's bf16 dot products
    (AVX-512 bf16: AMD Zen 4 / Zen 5, Intel from Cooper Lake)."""
    return linear_available() and bool(kernels().linear_packed_dp_available())


def gemm_nr() -> int:
    """Output columns per packed panel: 32 with AVX-512, 16 with AVX2 (cpu_kernels.c)."""
    return int(kernels().linear_packed_nr())


def pack_linear(weight: torch.Tensor, glu: bool = False, dp: bool | None = None
                ) -> torch.Tensor:
    """An nn.Linear weight [N, K] in the panel layout of `linear` (1-D, 64-byte aligned
    by torch's allocator, columns past N zero): fp32 for an fp32 weight; for a bf16 weight,
    bf16 panels (widened to fp32 in registers), or with dp (default: where `dp_available`)
    int32 panels, each value a k-pair of bf16 weights for the CPU's bf16 dot products.
    glu=True packs a fused [gate | up] weight [2I, K] for `linear(..., glu=True)`."""
    n, k = weight.shape
    if glu and n % 2:
        raise ValueError(f"a [gate | up] weight has an even number of rows, not {n}")
    bf16 = weight.dtype == torch.bfloat16
    w = weight.contiguous() if bf16 else weight.float().contiguous()
    nr = gemm_nr()
    panels = -(-(n // 2) // (nr // 2)) if glu else -(-n // nr)
    if bf16 and (dp_available() if dp is None else dp):
        out = torch.empty(panels * -(-k // 2) * nr, dtype=torch.int32)
        pack = kernels().pack_linear_weight_dp
    else:
        out = torch.empty(panels * k * nr, dtype=w.dtype)
        pack = kernels().pack_linear_weight_bf16 if bf16 else kernels().pack_linear_weight
    pack(w.data_ptr(), n, k, int(glu), out.data_ptr(), torch.get_num_threads())
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, accumulate: bool = False,
           glu: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T + bias -> [M, N], W [N, K] packed by `pack_linear`; fp32, or bf16
    x and W (bf16 or int32 panels) with fp32 sums and a bf16 result (rounded where torch's
    bf16 ops round).

    out: write there (contiguous [M, N]); with accumulate=True, out += x W^T + bias.
    glu: W is a [gate | up] weight packed with glu=True; returns silu(gate) * up [M, N/2]
    (no bias)."""
    dp = packed.dtype == torch.int32 and x.dtype == torch.bfloat16
    if not dp and (x.dtype != packed.dtype or x.dtype not in (torch.float32, torch.bfloat16)):
        raise TypeError(f"the packed GEMM multiplies fp32 or bf16 rows by a weight of the "
                        f"same dtype, not {x.dtype} x {packed.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if glu and bias is not None:
        raise ValueError("the fused silu(gate) * up takes no bias")
    if accumulate and out is None:
        raise ValueError("accumulate=True adds into `out`, which is missing")
    cols = n // 2 if glu else n
    y = torch.empty(m, cols, dtype=x.dtype) if out is None else out
    epi = EPI_GLU if glu else EPI_ADD if accumulate else EPI_STORE
    run = kernels().linear_packed
    if x.dtype == torch.bfloat16:
        run = kernels().linear_packed_dp if dp else kernels().linear_packed_bf16
        bias = None if bias is None else bias.float()       # widened: exact
    if run(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n, _ptr(bias), y.data_ptr(),
           cols, epi, torch.get_num_threads()):
        raise MemoryError("no memory for the GEMM's 1 MiB buffer")
    return y


def panels_taken_over() -> int:
    """Column panels of the packed GEMM done by a thread other than the one they were
    dealt to (it was done with its own and the owner had not reached them), since the
    library was loaded: how often a thread that lost its core was helped out."""
    return int(kernels().gemm_panels_taken_over())


def greedy_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [R] int64, logprobs [R] fp32) of fp32 logits [R, V]: each row's first
    maximum and its log_softmax value, as argmax and log_softmax give them."""
    if logits.dtype != torch.float32:
        raise TypeError(f"greedy_logprobs reads fp32 logits, not {logits.dtype}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, v = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    kernels().greedy_logprobs(logits.data_ptr(), rows, v, logits.stride(0), tokens.data_ptr(),
                              logprobs.data_ptr(), torch.get_num_threads())
    return tokens, logprobs
