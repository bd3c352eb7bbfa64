"""Faults on real processes started one by one (kill -9, Redis down): a restarted scheduler or
executor continues every request where its stream stopped, with the same output as no crash;
nothing hangs, and no KV block leaks after recovery. The same under `pagedserve serve`, which
restarts the services itself: tests/test_recovery.py."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import redis

from services.scheduler.service import SchedulerServiceConfig
from shared.redis_keys import CONSUMER_GROUP, MSG_FIELD
from tests.cluster import Cluster
from tests.conftest import start_redis, stop_process

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Outcome:
    tokens: int = 0              # chunks that carried text (a chunk may hold several tokens)
    usage_tokens: int = 0        # completion tokens, from the final usage chunk
    finish: str | None = None
    error: str | None = None
    status: int = 0
    text: str = ""
    ended_at: float = 0.0
    token_times: list = field(default_factory=list)   # monotonic arrival of each text chunk


def stream(base_url: str, prompt: str, max_tokens: int, out: Outcome) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.Client(base_url=base_url, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                out.status = r.status_code
                if r.status_code != 200:
                    out.error = r.read().decode()
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        out.error = ev["error"]["message"]
                        continue
                    if ev.get("usage"):
                        out.usage_tokens = ev["usage"]["completion_tokens"]
                    for ch in ev.get("choices", []):
                        if ch.get("text"):
                            out.tokens += 1
                            out.text += ch["text"]
                            out.token_times.append(time.monotonic())
                        if ch.get("finish_reason"):
                            out.finish = ch["finish_reason"]
    except httpx.HTTPError as exc:
        out.error = f"transport: {exc}"
    finally:
        out.ended_at = time.monotonic()


def launch(base_url, prompts, max_tokens):
    outs = [Outcome() for _ in prompts]
    threads = [threading.Thread(target=stream, args=(base_url, p, max_tokens, o), daemon=True)
               for p, o in zip(prompts, outs)]
    for t in threads:
        t.start()
    return outs, threads


def settle_blocks(cluster: Cluster, timeout: float = 10) -> float:
    deadline = time.monotonic() + timeout
    used = None
    while time.monotonic() < deadline:
        try:
            used = cluster.metric("pagedserve:gpu_blocks_used")
            if used == 0:
                return 0
        except KeyError:
            pass
        time.sleep(0.1)
    return used


@pytest.fixture
def private_redis():
    server = start_redis()
    yield server
    stop_process(server.proc)


@pytest.fixture
def cluster(private_redis):
    c = Cluster(private_redis.url, sched_flags=["--max-num-seqs", "4"])
    c.start_all()
    yield c
    c.stop_all()


def wait_until(what: str, ready, timeout: float) -> None:
    """Poll `ready()` until it is true; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.02)


def requests_with_output(cluster: Cluster) -> int:
    """How many requests a scheduler has published output for (a gateway's header entry in
    the same stream does not count)."""
    r = redis.Redis.from_url(cluster.redis_url)
    return sum(any(MSG_FIELD in fields for _eid, fields in r.xrange(key))
               for key in r.scan_iter(match=cluster.keys.output("*"), _type="STREAM"))


def test_scheduler_kill_9_is_invisible_to_the_client(cluster):
    prompts = [f"Story number {i}: once upon a time" for i in range(10)]
    new_tokens = 48
    outs, threads = launch(cluster.base_url, prompts, new_tokens)
    # kill while some requests stream and the rest (at most 4 run at once) still queue
    wait_until("two requests stream", lambda: sum(o.tokens > 0 for o in outs) >= 2, 120)
    cluster.kill("sched-a")
    started = requests_with_output(cluster)     # a dead scheduler publishes nothing more
    assert 2 <= started <= 4, f"{started} requests had started; --max-num-seqs is 4"
    cluster.start_scheduler("sched-a")
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a request hung after the scheduler restart"

    # The reference: the same prompts on the same stack, with no crash.
    reference, ref_threads = launch(cluster.base_url, prompts, new_tokens)
    for t in ref_threads:
        t.join(timeout=300)
    assert all(r.error is None and r.usage_tokens == new_tokens for r in reference), \
        [r.error for r in reference]
    # The successor continued the half-run requests from their streams and ran the rest.
    assert [o.error for o in outs] == [None] * len(prompts)
    for o, r in zip(outs, reference):
        assert o.finish == "length" and o.usage_tokens == new_tokens
        assert o.text == r.text
    assert settle_blocks(cluster) == 0


def test_executor_kill_9_pauses_the_stream_which_then_continues(cluster):
    prompt, new_tokens = "Tell me about the sea.", 48
    reference = Outcome()
    stream(cluster.base_url, prompt, new_tokens, reference)
    assert reference.error is None and reference.usage_tokens == new_tokens
    outs, threads = launch(cluster.base_url, [prompt], new_tokens)
    wait_until("three chunks stream", lambda: outs[0].tokens >= 3, 120)
    cluster.kill("executor")
    # The scheduler declares a silent executor dead after executor_timeout_s and probes
    # it (a 1 s gRPC deadline); then /health says why the stack cannot serve.
    wait_until("/health says degraded", lambda: cluster.get("/health")[0] == 503,
               SchedulerServiceConfig().executor_timeout_s + 10)
    assert "executor lost" in cluster.get("/health")[1]
    assert outs[0].error is None and not outs[0].finish     # the stream waits, open
    cluster.start_executor()
    threads[0].join(timeout=120)
    assert not threads[0].is_alive()
    assert outs[0].error is None and outs[0].usage_tokens == new_tokens
    assert outs[0].text == reference.text
    wait_until("/health is 200 again", lambda: cluster.get("/health")[0] == 200, 60)
    assert settle_blocks(cluster) == 0


def test_redis_down_gives_503_then_recovers(private_redis, cluster):
    stop_process(private_redis.proc)
    r = httpx.post(cluster.base_url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 503
    assert r.json()["error"]["message"]
    assert cluster.get("/health")[0] == 503
    restarted = start_redis(port=private_redis.port)
    try:
        wait_until("/health is 200 again", lambda: cluster.get("/health")[0] == 200, 60)
        out = Outcome()
        stream(cluster.base_url, "Back again", 6, out)
        assert out.error is None and out.usage_tokens == 6
    finally:
        stop_process(restarted.proc)


FAILING_DEVICE = """
from services.executor import model_runner
def _execute(self, plan):
    raise RuntimeError("device error (injected)")
model_runner.ModelRunner.execute = _execute
"""


def test_an_executor_that_fails_every_step_fails_each_request_within_its_retries(private_redis):
    c = Cluster(private_redis.url, sched_flags=["--max-num-seqs", "4"])
    try:
        c.start_executor(inject=FAILING_DEVICE)
        c.start_scheduler()
        c.start_gateway()
        t0 = time.monotonic()
        outs, threads = launch(c.base_url, [f"Prompt {i}" for i in range(6)], 8)
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a request hung"
        retries = SchedulerServiceConfig().max_step_retries
        for o in outs:
            assert o.error and f"failed {retries + 1} times" in o.error, o.error
            assert "device error (injected)" in o.error
        assert time.monotonic() - t0 < 30
        assert c.get("/health")[0] == 200           # the scheduler itself is fine
    finally:
        c.stop_all()


def test_a_second_scheduler_on_one_executor_stands_by_and_takes_over(cluster):
    prompts = [f"Story number {i}: once upon a time" for i in range(6)]
    reference, threads = launch(cluster.base_url, prompts, 24)
    for t in threads:
        t.join(timeout=300)
    cluster.start_scheduler("sched-b")            # same executor: refused, it stands by
    r = redis.Redis.from_url(cluster.redis_url)
    assert b"owned by the live scheduler 'sched-a'" in r.hget(cluster.keys.degraded, "sched-b")
    outs, threads = launch(cluster.base_url, prompts, 24)
    wait_until("two requests stream", lambda: sum(o.tokens > 0 for o in outs) >= 2, 120)
    cluster.kill("sched-a")                       # the standby takes the executor over
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert [o.error for o in outs] == [None] * len(prompts)
    assert [o.text for o in outs] == [ref.text for ref in reference]
    wait_until("sched-b serves", lambda: r.hget(cluster.keys.degraded, "sched-b") is None, 30)


def test_a_fenced_scheduler_restarted_as_a_standby_hands_its_requests_to_the_owner(cluster):
    """sched-a is stopped past its executor lease while it runs requests, sched-b takes the
    executor over, sched-a wakes up fenced (status 3) before its heartbeat is stale, and is
    restarted (as `serve` restarts a service): it stands by, beating under its name, so
    nobody would reclaim what it read. It hands those requests over; sched-b continues
    them, token-identical."""
    prompts = [f"Fence test {i}: the lighthouse keeper" for i in range(6)]
    reference, threads = launch(cluster.base_url, prompts, 32)
    for t in threads:
        t.join(timeout=300)
    cluster.start_scheduler("sched-b")            # stands by: sched-a owns the executor
    r = redis.Redis.from_url(cluster.redis_url)
    wait_until("sched-b stands by", lambda: r.hget(cluster.keys.degraded, "sched-b"), 60)
    outs, threads = launch(cluster.base_url, prompts, 32)
    wait_until("two requests stream", lambda: sum(o.tokens > 0 for o in outs) >= 2, 120)
    a = cluster.procs["sched-a"]
    os.kill(a.pid, signal.SIGSTOP)
    held = {p["message_id"] for p in r.xpending_range(
        cluster.keys.requests, CONSUMER_GROUP, "-", "+", 100, consumername="sched-a")}
    try:
        assert held, "sched-a held no request: the test proves nothing"
        # past the 5 s lease: sched-b owns the executor (its standby entry is gone)
        wait_until("sched-b takes the executor", lambda: r.hget(
            cluster.keys.degraded, "sched-b") is None, 30)
    finally:
        os.kill(a.pid, signal.SIGCONT)
    assert a.wait(timeout=30) == 3                # fenced
    taken = {p["message_id"] for p in r.xpending_range(
        cluster.keys.requests, CONSUMER_GROUP, "-", "+", 100, consumername="sched-b")}
    assert held - taken, "sched-b had reclaimed everything already: the test proves nothing"
    cluster.procs.pop("sched-a")
    cluster.start_scheduler("sched-a")            # restarted: a standby of the same name
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert [o.error for o in outs] == [None] * len(prompts)
    assert [o.text for o in outs] == [ref.text for ref in reference]
    assert b"owned by the live scheduler 'sched-b'" in r.hget(cluster.keys.degraded, "sched-a")


def test_an_undecodable_request_entry_is_answered_with_an_error(cluster):
    import msgpack

    from shared.messages import RequestOutput
    from shared.wire import WIRE_VERSION, decode
    r = redis.Redis.from_url(cluster.redis_url)
    # a request of a newer gateway: another wire version, its id still in the envelope
    entry = msgpack.packb([WIRE_VERSION + 1, "GenerationRequest", "from-the-future", [1, 2]])
    r.xadd(cluster.keys.requests, {MSG_FIELD: entry})
    wait_until("an answer on its output stream", lambda: r.xlen(
        cluster.keys.output("from-the-future")) > 0, 10)
    _eid, fields = r.xrange(cluster.keys.output("from-the-future"))[0]
    answer = decode(fields[MSG_FIELD], RequestOutput)
    assert answer.finished and answer.error_code == 400
    assert "cannot read this request" in answer.error
