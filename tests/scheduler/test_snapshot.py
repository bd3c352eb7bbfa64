"""The dashboard snapshot tells the block manager's truth, and the publisher stays quiet
while no page is open."""
from __future__ import annotations

import json

from services.scheduler.snapshot import DashboardPublisher, build_snapshot
from shared.dashboard import decode_snapshot, encode_snapshot, rle, runs, unrle, unruns
from shared.redis_keys import RedisKeys
from tests.scheduler.test_scheduler import Engine


def _check_against_pools(e: Engine) -> dict:
    snap = decode_snapshot(encode_snapshot(build_snapshot(e.sched, "s", 3, now=1.0)))
    bm = e.sched.block_manager
    for key, pool in (("gpu", bm.gpu), ("cpu", bm.cpu)):
        used = unruns(snap[key]["used"])
        assert used == [b for b in range(pool.num_blocks) if pool.ref_count[b]]
        assert unrle(snap[key]["ref"]) == [pool.ref_count[b] for b in used]
    assert sorted(unruns(snap["gpu"]["cached"])) == sorted(bm.gpu.cached.values())
    # every table entry of the snapshot is one reference: the ref counts add up
    refs = {"g": {}, "c": {}}
    for req in snap["reqs"]:
        for _seq, pool, table in req[7]:
            for b in table:
                refs[pool][b] = refs[pool].get(b, 0) + 1
    assert refs["g"] == {b: bm.gpu.ref_count[b] for b in unruns(snap["gpu"]["used"])}
    assert refs["c"] == {b: bm.cpu.ref_count[b] for b in unruns(snap["cpu"]["used"])}
    return snap


def test_runs_and_run_lengths_round_trip():
    for ids in ([], [0], [1, 2, 3, 7, 9, 10], list(range(50))):
        assert unruns(runs(ids)) == ids
    assert runs([1, 2, 3, 7, 9, 10]) == [1, 3, 7, 1, 9, 2]
    for vals in ([], [1], [1, 1, 2, 1, 3, 3, 3]):
        assert unrle(rle(vals)) == vals


def test_snapshot_shows_forks_prefix_sharing_and_swap():
    e = Engine(gpu=16, cpu=32, preemption_mode="swap")
    e.add("fork", 9, n=3, max_tokens=12)
    e.add("a", list(range(1, 14)), max_tokens=12)
    e.add("b", list(range(1, 14)) + [99], max_tokens=12)
    seen_shared = seen_swapped = False
    for _ in range(200):
        if not e.sched.has_unfinished():
            break
        e.step()
        snap = _check_against_pools(e)
        seen_shared |= any(r[4] > 0 for r in snap["reqs"])
        seen_swapped |= any(r[1] == "swapped" and r[5] >= 1 for r in snap["reqs"])
        assert json.loads(encode_snapshot(snap)) == snap
    assert seen_shared and seen_swapped
    snap = _check_against_pools(e)
    assert snap["reqs"] == [] and snap["gpu"]["used"] == []
    assert snap["c"]["gen_tokens"] > 0


def test_publisher_publishes_only_while_watched(redis_server):
    r = redis_server.client()
    keys = RedisKeys("snaptest")
    e = Engine()
    pub = DashboardPublisher(r, keys, "s1")
    pub.tick(e.sched)
    assert not r.exists(keys.dashboard("s1"))
    r.set(keys.dashboard_watchers, b"1", ex=3)
    pub._next_check = 0.0                     # the next tick looks again (it looks every 1 s)
    pub.tick(e.sched)
    snap = decode_snapshot(r.get(keys.dashboard("s1")))
    assert snap["name"] == "s1" and snap["seq"] == 1
    pub.tick(e.sched)                         # within 1 / PUBLISH_HZ: nothing new
    assert decode_snapshot(r.get(keys.dashboard("s1")))["seq"] == 1
