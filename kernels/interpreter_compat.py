"""bf16 under TRITON_INTERPRET=1: where the interpreter's numerics differ from a GPU's, and
the helpers the kernels use so that CPU tests check what the GPU computes.

The interpreter stores bf16 as uint16 (numpy has no bf16), and

- `tl.dot` multiplies those bit patterns as integers (triton-lang/triton#11584, bf16 is
  "not supported yet" there);
- an fp32 -> bf16 cast truncates (rounds toward zero), where a GPU rounds to nearest even:
  up to one bf16 ulp off, 1.6e-2 for values in [2, 4).

Each helper takes INTERPRET (a constexpr, `interpreting()` at launch): on a GPU it is
False and the helper compiles to the plain operation.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """a @ b, fp32 accumulation. Interpreted: on fp32 copies (the same products, exactly)."""
    if INTERPRET:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def cast(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """x.to(DTYPE), rounding to nearest even like a GPU, also under the interpreter."""
    if INTERPRET and DTYPE == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)      # round half to even on bit 16
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(DTYPE)
    return y
