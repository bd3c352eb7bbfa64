"""Repo-wide pytest setup.

Triton decides at decoration time whether a kernel is compiled or interpreted, so the
interpreter switch must be set before any module defining a kernel is imported. Without
a GPU, every Triton kernel runs under TRITON_INTERPRET=1 (exact, slow): that is how CI
checks them.
"""
import os

# The suite runs two workers side by side (Makefile: pytest -n 2), each starting stacks and
# in-process runners on the same few cores. OpenMP threads that spin at a barrier (the
# executor's default, launcher.executor_openmp_defaults, and libgomp's own) lose their
# cores to the other worker's busy threads in the middle of each parallel region: on two
# cores the two slowest stack tests ran 2-4x longer side by side than with threads that
# sleep at once (docs/overhead.md, "Two executors on one host"). So every process of the
# suite sleeps at once; results do not depend on it, and the default itself is checked by
# tests/test_launcher.py, which clears these. Set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "0")

try:
    import torch
    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard dependency
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every test process shares one model cache inside the checkout (ignored by git), so the
# bundled GGUF is converted once per clone, not once per test module.
os.environ.setdefault("PAGEDSERVE_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache"))
