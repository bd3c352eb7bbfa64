"""No request waits forever in the gateway: 503 with Retry-After while no scheduler is alive,
an error event when a quiet stream's scheduler is gone or its request was lost with Redis's
data, and a per-request deadline. (A scheduler that restarts only pauses a stream.)"""
from __future__ import annotations

import json
import time

import httpx

from shared.messages import SeqDelta
from tests.gateway.conftest import FakeScheduler, RedisProcess

MODEL = "SmolLM2-135M-Instruct"
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "stream": True}


def events(resp) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]


def test_no_scheduler_alive_is_503_with_retry_after_then_served(start_gateway, redis_proc):
    gw = start_gateway(scheduler_gone_s=1.0, retry_after_s=2)
    sched = FakeScheduler(redis_proc.url, gw.config.redis_prefix)
    sched.r.hset(sched.keys.schedulers, sched.name, f"{time.time() - 5:.3f}")   # it died
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        r = c.post("/v1/completions", json=dict(BODY, stream=False))
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "no_scheduler"
        assert sched.queued() == 0                        # nothing was queued
        sched.beat()                                      # a scheduler is back
        sched.serve_in_thread(lambda req: [([SeqDelta(0, [28], finish_reason="length")], True)])
        r = c.post("/v1/completions", json=dict(BODY, stream=False))
        assert r.status_code == 200, r.text


def one_token_then(gw, redis_proc, fault) -> tuple[list[dict], float, float]:
    """Stream a request that gets one token, then `fault(scheduler, request id)`: the SSE
    events, the seconds from the fault to the end of the stream, and the seconds from the
    scheduler's one heartbeat to the end of the stream."""
    sched = FakeScheduler(redis_proc.url, gw.config.redis_prefix)
    sched.beat()
    beat = time.monotonic()
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=BODY) as resp:
            taken = sched.take()
            sched.emit(taken.request.request_id, SeqDelta(0, [28]))
            t0 = time.monotonic()
            fault(sched, taken.request.request_id)
            got = events(resp)
    assert got[0]["choices"][0]["text"]
    end = time.monotonic()
    return got, end - t0, end - beat


def test_a_quiet_stream_whose_scheduler_is_gone_ends_with_an_error(start_gateway, redis_proc):
    gw = start_gateway(scheduler_gone_s=1.5, stall_check_s=0.5)
    got, waited, since_beat = one_token_then(gw, redis_proc, lambda sched, rid: None)  # it dies
    assert "no scheduler has been alive" in got[-1]["error"]["message"]
    # Not before the heartbeat is scheduler_gone_s old; then within a stall check (+ slack).
    assert since_beat > 1.5 and waited < 1.5 + 0.5 + 2.0


def test_a_request_lost_with_redis_data_ends_with_an_error(start_gateway, redis_proc):
    gw = start_gateway(stall_check_s=0.5)
    # as a Redis restart without its data: the output stream is gone
    got, _, _ = one_token_then(gw, redis_proc,
                            lambda sched, rid: sched.r.delete(sched.keys.output(rid)))
    assert "the request was lost" in got[-1]["error"]["message"]


def test_a_request_past_its_deadline_ends_with_504(start_gateway, redis_proc):
    gw = start_gateway(request_timeout_s=1.0, stall_check_s=60)
    sched = FakeScheduler(redis_proc.url, gw.config.redis_prefix)
    sched.beat()
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.post("/v1/completions", json=dict(BODY, stream=False))
    assert r.status_code == 504 and "longer than the server's limit" in r.text
    taken = sched.take()
    assert sched.wait_abort(taken.request.request_id) >= 0    # and it stops running


def test_redis_out_of_memory_is_503_not_500(start_gateway):
    rp = RedisProcess()
    rp.start()
    try:
        gw = start_gateway(redis_url=rp.url)
        FakeScheduler(rp.url, gw.config.redis_prefix).beat()
        rp.client().config_set("maxmemory", "1")        # every write now fails with OOM
        with httpx.Client(base_url=gw.url, timeout=10) as c:
            r = c.post("/v1/completions", json=dict(BODY, stream=False))
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        assert "out of memory" in r.json()["error"]["message"]
    finally:
        rp.stop()
