"""The scheduler's Redis link against a real redis-server: one round publishes, acknowledges
and reads, and what it read comes back typed whatever else the round asked for; a process
whose requests were taken over writes nothing more; Redis out of memory loses nothing."""
from __future__ import annotations

import time
import uuid

import pytest

from services.scheduler import redis_link
from services.scheduler.outputs import outgoing
from services.scheduler.redis_link import TTL_REFRESH_S, ClaimLost, Heartbeat, RedisLink
from shared.messages import (AbortRequest, GenerationRequest, RequestOutput, SamplingParams,
                             SeqDelta)
from shared.redis_keys import (CONSUMER_GROUP, FINISHED_OUTPUT_TTL_S, MSG_FIELD, OUTPUT_TTL_S,
                               RedisKeys)
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
    got = link.round([outgoing(out)], [], Heartbeat(1.5, "executor lost: test", b"m 1\n"), want=8)
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


def test_a_scheduler_whose_requests_were_taken_over_publishes_nothing_more(redis_server):
    stalled = _link(redis_server, "stalled")
    stalled.hold_claim()
    _enqueue(stalled, "a")
    ((eid, _),) = stalled.round([], [], None, want=8).requests
    stalled.round([outgoing(RequestOutput("a", [SeqDelta(0, [5])]))], [], None, read=False)
    # it stops beating; another takes its requests over and continues the stream
    successor = RedisLink(stalled.redis, stalled.keys, "successor")
    successor.hold_claim()
    assert [e for e, _ in successor.take_pending("stalled").requests] == [eid]
    successor.round([outgoing(RequestOutput("a", [SeqDelta(0, [6])]))], [], None, read=False)
    # the stalled one wakes up: neither its output nor its ack goes out
    with pytest.raises(ClaimLost):
        last = outgoing(RequestOutput("a", [SeqDelta(0, [9])], finished=True))
        stalled.round([last], [eid], None, read=False)
    written = [decode(f[MSG_FIELD], RequestOutput).seqs[0].token_ids
               for _, f in stalled.redis.xrange(stalled.keys.output("a"))]
    assert written == [[5], [6]]
    pending = stalled.redis.xpending_range(stalled.keys.requests, CONSUMER_GROUP, "-", "+", 10)
    assert [(p["message_id"].decode(), p["consumer"].decode()) for p in pending] == [
        (eid, "successor")]
    # a new process under the stalled one's name holds the name again
    again = RedisLink(stalled.redis, stalled.keys, "stalled")
    again.hold_claim()
    again.round([outgoing(RequestOutput("b", [SeqDelta(0, [1])]))], [], None, read=False)
    assert stalled.redis.xlen(stalled.keys.output("b")) == 1


def test_a_round_redis_refuses_out_of_memory_or_restarted_is_held_whole(redis_server):
    link = _link(redis_server)
    link.hold_claim()
    _enqueue(link, "a")
    link.redis.config_set("maxmemory", 1)            # every write that may grow is refused
    try:
        got = link.round([outgoing(RequestOutput("x", [SeqDelta(0, [5])]))], [], Heartbeat(1.0),
                         want=8)
        assert got.held == "Redis is out of memory (maxmemory)"
        assert not link.redis.exists(link.keys.output("x"))       # nothing half-written
        assert [r.request_id for _, r in got.requests] == ["a"]   # what it read is taken
    finally:
        link.redis.config_set("maxmemory", 0)
    got = link.round([outgoing(RequestOutput("x", [SeqDelta(0, [5])]))], [], Heartbeat(1.0))
    assert got.held is None and link.redis.xlen(link.keys.output("x")) == 1
    # Redis restarted (its scripts gone): the round is held, the next one publishes
    link.redis.script_flush()
    got = link.round([outgoing(RequestOutput("x", [SeqDelta(0, [6])]))], [], None, read=False)
    assert got.held and link.redis.xlen(link.keys.output("x")) == 1
    got = link.round([outgoing(RequestOutput("x", [SeqDelta(0, [6])]))], [], None, read=False)
    assert got.held is None and link.redis.xlen(link.keys.output("x")) == 2


def test_a_streams_ttl_is_set_by_its_first_output_then_only_when_due(redis_server,
                                                                     monkeypatch):
    """No EXPIRE per token: the TTL is set by the first output, again once TTL_REFRESH_S
    has passed, to the finished TTL by the last output, and by a round that finds Redis
    without its data; a held round records nothing."""
    link = _link(redis_server)
    link.hold_claim()
    r = link.redis

    def out(rid: str, token: int, finished: bool = False):
        return outgoing(RequestOutput(rid, [SeqDelta(0, [token])], finished=finished))

    key = link.keys.output("a")
    link.round([out("a", 1)], [], None, read=False)
    assert OUTPUT_TTL_S - 5 < r.ttl(key) <= OUTPUT_TTL_S
    r.expire(key, 5000)                  # a mark: a round that sets the TTL undoes it
    link.round([out("a", 2)], [], None, read=False)
    assert r.ttl(key) > 4000, "the second output set the TTL again"
    later = time.monotonic() + TTL_REFRESH_S + 1
    monkeypatch.setattr(redis_link.time, "monotonic", lambda: later)
    link.round([out("a", 3)], [], None, read=False)
    assert r.ttl(key) <= OUTPUT_TTL_S, "due after TTL_REFRESH_S"
    r.expire(key, 5000)
    link.round([out("a", 4)], [], None, read=False)
    assert r.ttl(key) > 4000
    link.round([out("a", 5, finished=True)], [], None, read=False)
    assert r.ttl(key) <= FINISHED_OUTPUT_TTL_S
    assert r.xlen(key) == 5
    # a held round (Redis restarted without the script): the next one sets the TTL
    r.script_flush()
    assert link.round([out("b", 1)], [], None, read=False).held
    link.round([out("b", 2)], [], None, read=False)
    assert 0 < r.ttl(link.keys.output("b")) <= OUTPUT_TTL_S
    # Redis lost its data (the claim key with it): every stream written gets its TTL
    r.delete(*r.keys(link.keys.prefix + ":*"))     # (this test's keys: the server is shared)
    link.round([out("b", 3), out("c", 1)], [], None, read=False)
    assert 0 < r.ttl(link.keys.output("b")) <= OUTPUT_TTL_S
    assert 0 < r.ttl(link.keys.output("c")) <= OUTPUT_TTL_S
    r.expire(link.keys.output("b"), 5000)
    link.round([out("b", 4)], [], None, read=False)
    assert 0 < r.ttl(link.keys.output("b")) <= OUTPUT_TTL_S, "set again after the loss"
