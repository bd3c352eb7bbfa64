"""A scheduler whose reconnect to a lost executor blocks (its gRPC calls take up to 9 s
together when the executor answers slowly) keeps its heartbeat in Redis: gateways see it
degraded ("executor lost"), not gone."""
from __future__ import annotations

import threading
import time

from services.launcher import free_port
from services.scheduler.service import SchedulerService, SchedulerServiceConfig

BLOCK_S = 6.0          # longer than a gateway's heartbeat_fresh_s (5 s)


def test_the_heartbeat_goes_on_while_a_reconnect_blocks(redis_server):
    svc = SchedulerService(SchedulerServiceConfig(
        redis_url=redis_server.url, redis_prefix=f"hb{free_port()}", name="sched-hb",
        executor=f"127.0.0.1:{free_port()}"))
    calls = []

    def slow_connect(timeout_s=None):
        calls.append(timeout_s)
        time.sleep(BLOCK_S)              # then the executor is back

    svc.connect = slow_connect
    r = redis_server.client()
    t = threading.Thread(target=svc.recovery.recover,
                         args=(None, "executor lost (test)", False), daemon=True)
    t.start()
    beats, degraded = [], []
    while t.is_alive():
        v = r.hget(svc.link.keys.schedulers, "sched-hb")
        if v is not None:
            beats.append(float(v))
            d = r.hget(svc.link.keys.degraded, "sched-hb")
            degraded.append(d.decode() if d else None)
        time.sleep(0.1)
    t.join()
    assert calls == [2.0]
    stamps = sorted(set(beats))
    assert stamps[-1] - stamps[0] >= BLOCK_S - 1.5, "no heartbeat during the reconnect"
    assert max(b - a for a, b in zip(stamps, stamps[1:])) < 2.5
    assert "executor lost (test)" in next(d for d in degraded if d)
