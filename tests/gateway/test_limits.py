"""Per-key budgets: one API key's open requests and tokens are bounded, the others' are not
touched, and a key's share comes back when its requests are answered."""
from __future__ import annotations

import contextlib
import time

import httpx

from services.gateway.queue import READERS_SUFFIX
from shared.messages import SeqDelta
from tests.gateway.conftest import FakeScheduler

MODEL = "SmolLM2-135M-Instruct"


def _body(max_tokens: int = 8, n: int = 1) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "n": n, "stream": True}


def _key(name: str) -> dict:
    return {"Authorization": f"Bearer {name}"}


def test_a_key_over_its_budget_gets_429_while_another_key_is_served(start_gateway, redis_proc):
    gw = start_gateway(api_keys=["flood", "calm"], key_max_requests=2, key_max_tokens=600,
                       retry_after_s=2)
    sched = FakeScheduler(redis_proc.url, gw.config.redis_prefix)
    sched.beat()
    with httpx.Client(base_url=gw.url, timeout=20) as c, contextlib.ExitStack() as open_:
        held = [open_.enter_context(c.stream("POST", "/v1/completions", json=_body(),
                                             headers=_key("flood"))) for _ in range(2)]
        assert [r.status_code for r in held] == [200, 200]       # both open, unanswered
        r = c.post("/v1/completions", json=_body(), headers=_key("flood"))
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "key_limit"
        assert "2 requests of this API key are open" in r.json()["error"]["message"]
        # the other key is not touched by the first one's flood
        calm = open_.enter_context(c.stream("POST", "/v1/completions", json=_body(),
                                            headers=_key("calm")))
        assert calm.status_code == 200
        # tokens: n * max_tokens counts, and one request may never hold more than the budget
        r = c.post("/v1/completions", json=_body(max_tokens=40, n=16), headers=_key("calm"))
        assert r.status_code == 400 and r.json()["error"]["code"] == "token_budget_exceeded"
        r = c.post("/v1/completions", json=_body(max_tokens=37, n=16), headers=_key("calm"))
        assert r.status_code == 429 and "hold" in r.json()["error"]["message"]
        # answer the flood's two requests: its share comes back
        for _ in range(2):
            taken = sched.take()
            sched.emit(taken.request.request_id, SeqDelta(0, [28], finish_reason="length"),
                       finished=True)
        for resp in held:
            resp.read()
    sched.serve_in_thread(lambda req: [([SeqDelta(0, [28], finish_reason="length")], True)])
    with httpx.Client(base_url=gw.url, timeout=20) as c:
        r = c.post("/v1/completions", json=dict(_body(), stream=False), headers=_key("flood"))
        assert r.status_code == 200, r.text


def test_a_dropped_resumable_stream_keeps_its_share_while_a_resumed_connection_follows_it(
        start_gateway, redis_proc):
    gw = start_gateway(api_keys=["k"], key_max_requests=1, retry_after_s=1)
    sched = FakeScheduler(redis_proc.url, gw.config.redis_prefix)
    sched.beat()
    resumable = {**_key("k"), "X-Resumable-Stream": "true"}
    with httpx.Client(base_url=gw.url, timeout=20) as c:
        with c.stream("POST", "/v1/completions", json=_body(), headers=resumable) as first:
            assert first.status_code == 200
            rid = sched.take().request.request_id
            sched.emit(rid, SeqDelta(0, [28]))
            next(line for line in first.iter_lines() if line.startswith("data: "))
        # dropped; a resumed connection follows the request from here
        with c.stream("GET", f"/v1/streams/{rid}", headers=_key("k")) as resumed:
            assert resumed.status_code == 200
            deadline = time.monotonic() + 10
            readers = sched.keys.output(rid) + READERS_SUFFIX
            while int(sched.r.get(readers) or 0) != 1:     # it attached, the first left
                assert time.monotonic() < deadline, "the resumed connection never attached"
                time.sleep(0.02)
            # the request still runs, so it still holds the key's one request, however long
            # the first connection's task takes to notice the resumed one (it polls 4 x/s)
            until = time.monotonic() + 1.5
            while time.monotonic() < until:
                r = c.post("/v1/completions", json=dict(_body(), stream=False),
                           headers=_key("k"))
                assert r.status_code == 429, r.text
            sched.emit(rid, SeqDelta(0, [28], finish_reason="length"), finished=True)
            resumed.read()
    # it finished: the share is back
    sched.serve_in_thread(lambda req: [([SeqDelta(0, [28], finish_reason="length")], True)])
    with httpx.Client(base_url=gw.url, timeout=20) as c:
        deadline = time.monotonic() + 10
        while (r := c.post("/v1/completions", json=dict(_body(), stream=False),
                           headers=_key("k"))).status_code == 429:
            assert time.monotonic() < deadline, "the share never came back"
            time.sleep(0.1)
        assert r.status_code == 200, r.text
