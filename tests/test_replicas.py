"""Data parallelism: two scheduler+executor replicas consume one Redis queue; a replica that
is stalled, then wakes, never becomes a second writer of a stream."""
from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from services.gateway.queue import READERS_SUFFIX
from shared.messages import RequestOutput
from shared.redis_keys import CONSUMER_GROUP, MSG_FIELD
from shared.wire import decode
from tests.cluster import Cluster
from tests.conftest import start_redis, stop_process
from tests.test_faults import launch, wait_until


@pytest.fixture
def two_replicas():
    server = start_redis()
    c = Cluster(server.url, sched_flags=["--max-num-seqs", "2"])
    c.start_executor("exec-a")
    c.start_executor("exec-b")
    c.start_scheduler("sched-a", "exec-a")
    c.start_scheduler("sched-b", "exec-b")
    c.start_gateway()
    yield c
    c.stop_all()
    stop_process(server.proc)


def _served_by(cluster: Cluster) -> dict[str, float]:
    """Generation tokens per scheduler, from the merged /metrics."""
    _, text = cluster.get("/metrics")
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:generation_tokens_total{"):
            name = line.split('scheduler="', 1)[1].split('"', 1)[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def test_both_replicas_serve_and_every_request_of_a_dead_one_completes(two_replicas):
    c = two_replicas
    outs, threads = launch(c.base_url, [f"Replica test {i}: the ocean" for i in range(12)], 24)
    # each replica runs at most 2 at a time, so most requests queue in Redis or in a replica
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        served = _served_by(c)
        if served.get("sched-a", 0) > 0 and served.get("sched-b", 0) > 0:
            break
        time.sleep(0.1)
    assert served.get("sched-a", 0) > 0 and served.get("sched-b", 0) > 0, served
    c.kill("sched-b")          # its executor is left without a scheduler
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a request hung after a replica died"
    # Those sched-b had queued are run by sched-a; those it was running continue there
    # from the tokens their streams hold: no client sees an error.
    assert [o.error for o in outs] == [None] * 12
    for o in outs:
        assert o.usage_tokens == 24 and o.finish == "length"


def _published(cluster: Cluster) -> dict[str, tuple[int, int]]:
    """request id -> (tokens published, final outputs published), read from every output
    stream in Redis: what the schedulers wrote, whoever wrote it."""
    r = redis.Redis.from_url(cluster.redis_url)
    out = {}
    for key in r.scan_iter(match=cluster.keys.output("*"), count=1000):
        if key.endswith(READERS_SUFFIX.encode()):
            continue
        tokens = finals = 0
        for _eid, fields in r.xrange(key):
            if MSG_FIELD in fields:
                msg = decode(fields[MSG_FIELD], RequestOutput)
                tokens += sum(len(d.token_ids) for d in msg.seqs)
                finals += msg.finished
        out[key.decode().rsplit(":", 1)[1]] = (tokens, finals)
    return out


def test_a_replica_stalled_past_the_heartbeat_timeout_never_writes_again(two_replicas):
    """SIGSTOP one replica mid-stream for longer than the heartbeat timeout: the other takes
    its requests over and continues them from their streams. On SIGCONT the stalled one
    finds its claim taken and stops without publishing, so each stream has one writer and
    every request completes exactly once, with every token once."""
    c = two_replicas
    max_tokens = 32
    outs, threads = launch(c.base_url, [f"Stall test {i}: the river" for i in range(8)],
                           max_tokens)
    r = redis.Redis.from_url(c.redis_url)
    wait_until("sched-a streaming", lambda: _served_by(c).get("sched-a", 0) > 0, 90)
    os.kill(c.procs["sched-a"].pid, signal.SIGSTOP)
    held = r.xpending_range(c.keys.requests, CONSUMER_GROUP, "-", "+", 100,
                            consumername="sched-a")
    try:
        assert held, "the stalled replica held no request: the test proves nothing"
        # past the 10 s heartbeat timeout, and until sched-b took the requests over
        wait_until("sched-b takes sched-a's requests over", lambda: not r.xpending_range(
            c.keys.requests, CONSUMER_GROUP, "-", "+", 100, consumername="sched-a"), 60)
    finally:
        os.kill(c.procs["sched-a"].pid, signal.SIGCONT)
    # its first publication after waking is refused: it stops (status 3) without writing
    assert c.procs["sched-a"].wait(timeout=30) == 3
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert [o.error for o in outs] == [None] * 8
    assert all(o.usage_tokens == max_tokens and o.finish == "length" for o in outs)
    published = _published(c)
    assert len(published) == 8
    # two writers would publish some tokens twice, or a second final output
    assert sorted(published.values()) == [(max_tokens, 1)] * 8, published
