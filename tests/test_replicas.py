"""Data parallelism: two scheduler+executor replicas consume one Redis queue."""
from __future__ import annotations

import time

import pytest

from tests.cluster import Cluster
from tests.conftest import start_redis, stop_process
from tests.test_faults import launch


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


def test_both_replicas_serve_and_a_dead_one_loses_no_queued_request(two_replicas):
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
    done = [o for o in outs if o.error is None]
    for o in done:
        assert o.usage_tokens == 24 and o.finish == "length"
    for o in outs:
        if o.error is not None:
            assert "retry" in o.error     # it had started on the dead replica: explicit error
    # every request sched-b had taken but not started was re-run by sched-a
    assert len(done) >= 12 - 2
    assert len(done) + sum(o.error is not None for o in outs) == 12
