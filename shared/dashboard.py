"""The KV block-map snapshot: what a scheduler publishes for `GET /dashboard`.

One snapshot is one JSON object (the gateway relays it to the page verbatim, as one SSE
event, so the page parses it with JSON.parse and nothing in between decodes it). Block ids
travel as runs and per-block values as run-length pairs, so a pool of 10^5 blocks where a
few requests hold contiguous stretches is a few hundred numbers, not 10^5.

    {"v": 1,                       SNAPSHOT_VERSION
     "name": "sched-a",            the publishing scheduler (one snapshot key per replica)
     "seq": 17,                    increases with each snapshot of this scheduler
     "t": 1764600000.25,           unix seconds when it was built
     "block_size": 16,
     "tp": 2,                      executor ranks the pool is sharded over (KV heads split;
                                   every rank holds every block id, so still one map)
     "gpu": {"n": 4096,            physical GPU blocks
             "used": [s, len, ...],      runs of block ids with ref count > 0, ascending
             "ref": [v, count, ...],     their ref counts, run-length, in the same order
             "cached": [s, len, ...]},   runs of block ids registered in the prefix cache
     "cpu": {"n": 512, "used": [...], "ref": [...]},      the swap pool (nothing is cached)
     "reqs": [[request_id, status, tokens, blocks, shared, preemptions, ttft_s,
               [[seq_id, pool, [block ids...]], ...]], ...],
     "c": {"running": .., "waiting": .., "swapped": .., "gen_tokens": .., "prompt_tokens": ..,
           "preemptions": .., "prefix_queries": .., "prefix_hits": ..}}

`status` is "running", "waiting" or "swapped"; `pool` is "g" (GPU ids) or "c" (CPU ids: the
seq is swapped out); `tokens` counts the request's output tokens so far (all its seqs);
`blocks` the distinct blocks its seqs map, `shared` those of them whose ref count is > 1;
`ttft_s` is null until the first token. `c` holds totals since the scheduler started (the
page turns them into rates) and the queue lengths now.

The gateway keeps `RedisKeys.dashboard_watchers` alive (a short TTL) while a page is open;
a scheduler builds and publishes snapshots only while that key exists, at most
PUBLISH_HZ times a second, under `RedisKeys.dashboard(name)` with a TTL of SNAPSHOT_TTL_S.
"""
from __future__ import annotations

import json
from itertools import groupby
from typing import Any, Iterable

SNAPSHOT_VERSION = 1
PUBLISH_HZ = 4.0            # snapshots per second per scheduler, at most
WATCHERS_TTL_S = 3          # the gateway refreshes the watchers key every second while streaming
SNAPSHOT_TTL_S = 5          # a stopped scheduler's last snapshot disappears after this
WATCH_CHECK_S = 1.0         # a scheduler looks for the watchers key this often


def runs(ids: Iterable[int]) -> list[int]:
    """Ascending ids as [start, length, start, length, ...]."""
    out: list[int] = []
    start = prev = None
    for b in ids:
        if prev is not None and b == prev + 1:
            prev = b
            continue
        if start is not None:
            out += (start, prev - start + 1)
        start = prev = b
    if start is not None:
        out += (start, prev - start + 1)
    return out


def unruns(flat: list[int]) -> list[int]:
    return [b for i in range(0, len(flat), 2) for b in range(flat[i], flat[i] + flat[i + 1])]


def rle(values: Iterable[int]) -> list[int]:
    """[value, count, value, count, ...]."""
    out: list[int] = []
    for v, group in groupby(values):
        out += (v, sum(1 for _ in group))
    return out


def unrle(flat: list[int]) -> list[int]:
    return [flat[i] for i in range(0, len(flat), 2) for _ in range(flat[i + 1])]


def encode_snapshot(snapshot: dict[str, Any]) -> bytes:
    return json.dumps(snapshot, separators=(",", ":")).encode()


def decode_snapshot(data: bytes | str) -> dict[str, Any]:
    snap = json.loads(data)
    if not isinstance(snap, dict) or snap.get("v") != SNAPSHOT_VERSION:
        raise ValueError(f"not a version-{SNAPSHOT_VERSION} dashboard snapshot")
    return snap
