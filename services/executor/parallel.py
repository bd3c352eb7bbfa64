"""Tensor parallelism: the process group of one executor's ranks and how weights are split.

    rank r of N holds
      attention  q heads [r*Hq/N, (r+1)*Hq/N)  and kv heads [r*Hkv/N, (r+1)*Hkv/N)
                 (qkv rows and o_proj columns of those heads; its share of every KV block)
      MLP        intermediate rows [I_r, I_r+1) of gate/up, the same columns of down
      replicated embedding, norms, LM head (rank 0 only computes logits)

Each layer ends its attention and its MLP with an all-reduce (sum) of the partial
[T, H] outputs; the biases of o_proj and down_proj are added by rank 0 alone. Every rank
applies the same plan to the same state, so one block id names the same block on every
rank; capacity is the minimum over the ranks. NCCL on GPUs, gloo on the CPU.
"""
from __future__ import annotations

import logging
import math
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch

from services.executor.config import ExecutorConfigError

log = logging.getLogger(__name__)


class TensorParallelError(ExecutorConfigError):
    """The model cannot be split this way; the message says which sizes would work."""


@dataclass(frozen=True, slots=True)
class Shard:
    """Which slice of the model one rank holds."""

    rank: int = 0
    size: int = 1

    def check(self, num_heads: int, num_kv_heads: int) -> None:
        """Refuse a split that would cut a head in two, naming the sizes that work."""
        if num_heads % self.size or num_kv_heads % self.size:
            g = math.gcd(num_heads, num_kv_heads)
            sizes = ", ".join(str(n) for n in range(1, g + 1) if g % n == 0)
            raise TensorParallelError(
                f"the model's {num_heads} attention heads and {num_kv_heads} key/value heads "
                f"cannot be split evenly over {self.size} ranks: use a tensor-parallel size "
                f"that divides both ({sizes})")

    def heads(self, total: int) -> tuple[int, int]:
        """[first, end) of this rank's heads (`check` first: heads never split unevenly)."""
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def span(self, total: int) -> tuple[int, int]:
        """[first, end) of this rank's part of a dimension that may split unevenly."""
        base, extra = divmod(total, self.size)
        first = self.rank * base + min(self.rank, extra)
        return first, first + base + (self.rank < extra)


def _rendezvous_store(shard: Shard, host: str, port: int, timeout: timedelta):
    """The key-value store the ranks meet at: rank 0 serves it on `host`:`port` only.

    NOTE: torch's TCPStore server listens on every interface whatever host it is given;
    handed a socket already bound to `host`, it listens there alone. The store takes
    unauthenticated writes, so it stays on the address the executor was told to use.
    """
    from torch.distributed import TCPStore

    if shard.rank != 0:
        return TCPStore(host, port, shard.size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ExecutorConfigError(f"the tensor-parallel rendezvous cannot listen on "
                                  f"{host}:{port} ({exc.strerror}): free the port or pass "
                                  f"another --dist-port") from None
    return TCPStore(host, port, shard.size, True, timeout, wait_for_workers=False,
                    master_listen_fd=sock.detach())


class ProcessGroup:
    """The ranks of one executor. With one rank every collective is a no-op."""

    def __init__(self, shard: Shard, backend: str | None = None) -> None:
        self.shard = shard
        self.backend = backend

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    @classmethod
    def connect(cls, shard: Shard, device: torch.device, host: str, port: int,
                timeout_s: float) -> "ProcessGroup":
        """Join the group (blocks until every rank has joined); a no-op for one rank."""
        if shard.size == 1:
            return cls(shard)
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(device)
        if host in ("127.0.0.1", "localhost"):
            # NOTE: gloo and NCCL's bootstrap use the interface of the machine's hostname
            # unless told; ranks on one machine talk over loopback.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        log.info("rank %d/%d joining the %s group at %s:%d", shard.rank, shard.size, backend,
                 host, port)
        timeout = timedelta(seconds=timeout_s)
        store = _rendezvous_store(shard, host, port, timeout)
        dist.init_process_group(backend, store=store, rank=shard.rank, world_size=shard.size,
                                timeout=timeout)
        return cls(shard, backend)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        if self.size > 1:
            import torch.distributed as dist
            dist.all_reduce(t)
        return t

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        if self.size == 1:
            return value
        import torch.distributed as dist
        device = "cuda" if self.backend == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        if self.size > 1:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
