"""The block-map snapshot of a scheduler, and its publisher (see shared/dashboard.py).

`build_snapshot` walks the whole GPU pool once (O(pool), in C-speed list operations) and
every live request's block tables once; it runs only while a dashboard page is open, at most
PUBLISH_HZ times a second, and never more than about 1/MAX_SHARE of the loop's time: after a
snapshot that took t seconds to build, the next waits at least MAX_SHARE * t (a pool of 10^5
blocks is published less often than 4 times a second, rather than slowing every step).
`DashboardPublisher.tick` is called once per loop iteration and costs one clock read unless
a check or a publish is due.
"""
from __future__ import annotations

import logging
import time
from itertools import compress
from typing import TYPE_CHECKING, Any

import redis

from shared.dashboard import (PUBLISH_HZ, SNAPSHOT_TTL_S, SNAPSHOT_VERSION, WATCH_CHECK_S,
                              encode_snapshot, rle, runs)
from shared.redis_keys import RedisKeys

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler

log = logging.getLogger("pagedserve.scheduler")

_STATUS = {0: "waiting", 1: "running", 2: "swapped"}
MAX_SHARE = 50       # snapshots take at most ~1/50 (2 %) of the scheduler loop's time


def _pool(ref_count: list[int]) -> tuple[list[int], list[int]]:
    """(runs of the used block ids, their ref counts run-length) of one pool."""
    return (runs(compress(range(len(ref_count)), ref_count)),
            rle(compress(ref_count, ref_count)))


def build_snapshot(sched: Scheduler, name: str, seq: int = 0,
                   now: float | None = None, tp: int = 1) -> dict[str, Any]:
    """Everything the dashboard draws, as the JSON-ready dict shared/dashboard.py describes."""
    bm = sched.block_manager
    gpu, cpu = bm.gpu, bm.cpu
    gpu_runs, gpu_ref = _pool(gpu.ref_count)
    cpu_runs, cpu_ref = _pool(cpu.ref_count)
    reqs = []
    for group in sched.groups.values():
        status = _STATUS.get(int(group.status))
        if status is None:              # finished, not yet dropped
            continue
        pool = "c" if status == "swapped" else "g"
        ref = cpu.ref_count if pool == "c" else gpu.ref_count
        tables = []
        held: set[int] = set()
        tokens = 0
        for s in group.seqs:
            tables.append([s.seq_id, pool, list(s.block_table)])
            held.update(s.block_table)
            tokens += max(0, len(s.token_ids) - s.prompt_len)
        shared = sum(1 for b in held if ref[b] > 1)
        ttft = (round(group.first_token_at - group.arrival_time, 4)
                if group.first_token_at and group.arrival_time else None)
        reqs.append([group.request_id, status, tokens, len(held), shared,
                     group.num_preemptions, ttft, tables])
    return {
        "v": SNAPSHOT_VERSION, "name": name, "seq": seq,
        "t": round(time.time() if now is None else now, 3), "block_size": bm.block_size,
        "tp": tp,
        "gpu": {"n": gpu.num_blocks, "used": gpu_runs, "ref": gpu_ref,
                "cached": runs(sorted(gpu.cached.values()))},
        "cpu": {"n": cpu.num_blocks, "used": cpu_runs, "ref": cpu_ref},
        "reqs": reqs,
        "c": {"running": len(sched.running), "waiting": sched.num_waiting,
              "swapped": len(sched.swapped),
              "gen_tokens": sched.generation_tokens_total,
              "prompt_tokens": sched.prompt_tokens_total,
              "preemptions": sched.num_preemptions,
              "prefix_queries": sched.prefix_cache_queries,
              "prefix_hits": sched.prefix_cache_hits},
    }


class DashboardPublisher:
    """Publishes snapshots while the gateway says a page is open; nothing otherwise."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, name: str) -> None:
        self.redis = client
        self.keys = keys
        self.name = name
        self.watched = False
        self.seq = 0
        self.tp = 1              # tensor-parallel ranks of the executor (set on connect)
        self._next_check = 0.0
        self._next_publish = 0.0

    def tick(self, sched: Scheduler | None) -> None:
        now = time.monotonic()
        if now < self._next_check and (not self.watched or now < self._next_publish):
            return
        try:
            if now >= self._next_check:
                self._next_check = now + WATCH_CHECK_S
                self.watched = bool(self.redis.exists(self.keys.dashboard_watchers))
            if self.watched and sched is not None and now >= self._next_publish:
                self.seq += 1
                data = encode_snapshot(build_snapshot(sched, self.name, self.seq, tp=self.tp))
                took = time.monotonic() - now
                self._next_publish = now + max(1.0 / PUBLISH_HZ, MAX_SHARE * took)
                self.redis.set(self.keys.dashboard(self.name), data, ex=SNAPSHOT_TTL_S)
        except redis.RedisError as exc:      # the dashboard never stops the engine
            log.debug("dashboard snapshot not published: %s", exc)
