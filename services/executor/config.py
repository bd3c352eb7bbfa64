"""ExecutorConfig: everything one executor process needs to load a model and size its KV pool."""
from __future__ import annotations

import os
from dataclasses import dataclass

from shared.model_source import BUNDLED_NAME

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


class ExecutorConfigError(ValueError):
    """A setting is invalid; the message says which and what to pass instead."""


@dataclass(slots=True)
class ExecutorConfig:
    model: str = BUNDLED_NAME          # served name, .gguf path or HF folder (shared.model_source)
    # auto: bf16 on a GPU (fp16 without bf16); on a CPU bf16 where it is native and measured
    # faster (AMX; AVX-512 bf16 on AMD), else fp32 (cpu_gemm.auto_cpu_dtype)
    dtype: str = "auto"
    device: str = "auto"               # auto: cuda when available, else cpu
    # KV cache: auto = the model's dtype; bfloat16 under a float32 model (CPU) halves the
    # cache's bytes per token (twice the tokens in kv_cache_gib, half the attention's reads)
    kv_cache_dtype: str = "auto"
    block_size: int = 16               # tokens per KV block
    kv_cache_gib: float = 1.0          # CPU only: KV pool budget (GiB)
    gpu_memory_utilization: float = 0.9  # GPU only: fraction of total memory the process may use
    swap_space_gib: float = 1.0        # host pool for swapped-out blocks (GiB), pinned with a GPU
    max_num_batched_tokens: int = 2048  # tokens per step (sizes the profiling forward)
    max_model_len: int | None = None   # tokens per sequence; None = the model's max positions
    seed: int = 0                      # RNG of unseeded requests
    num_threads: int = 0               # CPU intra-op threads; 0 = one per core
    num_gpu_blocks: int | None = None  # override the sized KV pool (tests, capacity experiments)
    # GPU decode steps of up to this many sequences replay a CUDA graph; 0: always eager
    cuda_graph_max_batch: int = 256
    # Tensor parallelism: this process is rank `rank` of `tensor_parallel_size`, joining the
    # others through a torch.distributed rendezvous at dist_host:dist_port.
    tensor_parallel_size: int = 1
    rank: int = 0
    dist_host: str = "127.0.0.1"
    dist_port: int = 29500
    dist_timeout_s: float = 600.0      # a collective waiting longer than this fails the rank

    def validate(self) -> None:
        """Raise ExecutorConfigError naming the first bad setting."""
        if self.dtype not in DTYPES:
            raise ExecutorConfigError(f"dtype {self.dtype!r} is not supported: use one of {DTYPES}")
        if self.kv_cache_dtype not in DTYPES:
            raise ExecutorConfigError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not "
                                      f"supported: use one of {DTYPES}")
        if self.device not in DEVICES:
            raise ExecutorConfigError(
                f"device {self.device!r} is not supported: use one of {DEVICES}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ExecutorConfigError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ExecutorConfigError("gpu_memory_utilization must be in (0, 1], got "
                                      f"{self.gpu_memory_utilization}")
        for name in ("kv_cache_gib", "swap_space_gib"):
            if getattr(self, name) < 0:
                raise ExecutorConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_threads < 0:
            raise ExecutorConfigError(f"num_threads must be >= 0 (0: one per core), got "
                                      f"{self.num_threads}")
        if self.cuda_graph_max_batch < 0:
            raise ExecutorConfigError("cuda_graph_max_batch must be >= 0 (0 disables CUDA "
                                      f"graphs), got {self.cuda_graph_max_batch}")
        if self.max_num_batched_tokens < 1:
            raise ExecutorConfigError("max_num_batched_tokens must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ExecutorConfigError("tensor_parallel_size must be >= 1, got "
                                      f"{self.tensor_parallel_size}")
        if not 0 <= self.rank < self.tensor_parallel_size:
            raise ExecutorConfigError(f"rank must be in [0, {self.tensor_parallel_size}), "
                                      f"got {self.rank}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ExecutorConfigError("max_model_len must be >= 1 (or None for the model's own)")

    @classmethod
    def from_env(cls, prefix: str = "PAGEDSERVE_") -> "ExecutorConfig":
        """Defaults overridden by environment variables named PREFIX + FIELD in upper case
        (PAGEDSERVE_DTYPE=bfloat16, PAGEDSERVE_KV_CACHE_GIB=4, ...)."""
        cfg = cls()
        for name, default in ((n, getattr(cfg, n)) for n in cls.__slots__):
            raw = os.environ.get(prefix + name.upper())
            if raw is None:
                continue
            kind = type(default) if default is not None else (str if name == "model" else int)
            try:
                setattr(cfg, name, None if raw.lower() == "none" else kind(raw))
            except ValueError:
                raise ExecutorConfigError(
                    f"{prefix + name.upper()}={raw!r} is not a valid {kind.__name__}") from None
        return cfg
