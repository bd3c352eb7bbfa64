"""The CPU kernels of another git revision, built beside the current ones, for benchmarks
that time both in turns in one process (`--baseline REV`)."""
from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

from services.executor import cpu_kernels


def build_kernels(rev: str, tmp: Path) -> ctypes.CDLL:
    """REV's cpu_kernels.c compiled and linked as cpu_kernels.py does, with the current
    library's ctypes signatures for every function both declare (trailing arguments a
    revision does not declare are ignored by its kernel: in the x86-64 and arm64 C calling
    conventions the caller removes them)."""
    repo = Path(__file__).resolve().parents[1]
    src = tmp / "cpu_kernels.c"
    src.write_bytes(subprocess.run(["git", "show", f"{rev}:services/executor/cpu_kernels.c"],
                                   cwd=repo, check=True, capture_output=True).stdout)
    cc = os.environ.get("CC", "gcc")
    obj, so = tmp / "cpu_kernels.o", tmp / "cpu_kernels.so"
    subprocess.run([cc, *cpu_kernels._CFLAGS, "-c", str(src), "-o", str(obj)], check=True)
    subprocess.run([cc, *cpu_kernels._LDFLAGS, str(obj), "-o", str(so), "-lm"], check=True)
    lib = ctypes.CDLL(str(so))
    cur = cpu_kernels.kernels()
    for name, fn in vars(cur).items():       # the functions cpu_kernels declared
        if isinstance(fn, ctypes._CFuncPtr) and hasattr(lib, name):
            theirs = getattr(lib, name)
            theirs.argtypes, theirs.restype = fn.argtypes, fn.restype
    return lib


class Using:
    """`with Using(lib):` cpu_kernels' functions call `lib` meanwhile."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def __enter__(self) -> None:
        self.saved, cpu_kernels._lib = cpu_kernels._lib, self.lib

    def __exit__(self, *exc) -> None:
        cpu_kernels._lib = self.saved
