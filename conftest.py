"""Repo-wide pytest setup.

Triton decides at decoration time whether a kernel is compiled or interpreted, so the
interpreter switch must be set before any module defining a kernel is imported. Without
a GPU, every Triton kernel runs under TRITON_INTERPRET=1 (exact, slow): that is how CI
checks them.
"""
import os

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
