"""The scheduler's Redis link against a real redis-server: one round publishes, acknowledges
and reads, and what it read comes back typed whatever else the round asked for."""
from __future__ import annotations

import uuid

from services.scheduler.redis_link import Heartbeat, RedisLink
from shared.messages import AbortRequest, GenerationRequest, RequestOutput, SamplingParams
from shared.redis_keys import CONSUMER_GROUP, MSG_FIELD, RedisKeys
from shared.wire import decode, encode


def _link(redis_server, name="s1") -> RedisLink:
    link = RedisLink(redis_server.client(), RedisKeys(f"t{uuid.uuid4().hex[:8]}"), name)
    link.ensure_group()
    return link


def _enqueue(link: RedisLink, rid: str) -> None:
    req = GenerationRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4))
    link.redis.xadd(link.keys.requests, {MSG_FIELD: encode(req)})


def test_a_round_returns_requests_and_aborts_typed_whatever_it_asked(redis_server):
    link = _link(redis_server)
    _enqueue(link, "a")
    link.redis.xadd(link.keys.requests, {MSG_FIELD: b"not msgpack"})
    link.redis.xadd(link.keys.aborts, {MSG_FIELD: encode(AbortRequest("z", "client gone"))})
    out = RequestOutput("old", [], finished=True)
    # Outputs, a heartbeat with metrics, aborts and requests in one round trip:
    got = link.round([out], [], Heartbeat(1.5, "executor lost: test", b"m 1\n"), want=8)
    assert [(r.request_id, type(r).__name__) for _, r in got.requests] == [
        ("a", "GenerationRequest")]
    assert len(got.malformed) == 1 and got.aborts == [AbortRequest("z", "client gone")]
    ((_, fields),) = link.redis.xrange(link.keys.output("old"))
    assert decode(fields[MSG_FIELD], RequestOutput) == out
    assert link.redis.hget(link.keys.degraded, "s1") == b"executor lost: test"
    # Aborts only (no room for requests, no heartbeat): still typed, nothing misread.
    _enqueue(link, "b")
    link.redis.xadd(link.keys.aborts, {MSG_FIELD: encode(AbortRequest("y"))})
    got = link.round([], [], None, want=0)
    assert got.requests == [] and got.aborts == [AbortRequest("y")]
    got = link.round([], [], None, read=False)
    assert got.requests == [] and got.aborts == []


def test_acknowledged_entries_leave_the_stream_and_a_dead_consumers_work_is_taken_over(
        redis_server):
    dead = _link(redis_server, "dead")
    _enqueue(dead, "a")
    _enqueue(dead, "b")
    (eid_a, _), (eid_b, _) = dead.round([], [], None, want=8).requests
    dead.round([], [eid_a], None, read=False)
    assert [e.decode() for e, _ in dead.redis.xrange(dead.keys.requests)] == [eid_b]
    alive = RedisLink(dead.redis, dead.keys, "alive")
    assert alive.dead_schedulers(now=0.0) == ["dead"]     # it never beat
    taken = alive.take_pending("dead")
    assert [(e, r.request_id) for e, r in taken.requests] == [(eid_b, "b")]
    consumers = [c["name"] for c in alive.redis.xinfo_consumers(alive.keys.requests,
                                                                CONSUMER_GROUP)]
    assert b"dead" not in consumers and "dead" not in consumers
