"""A plan or a result too large for the wire (MAX_MESSAGE_BYTES, ZeroMQ's MAXMSGSIZE) is never
sent: ZeroMQ would drop the receiver's connection without a word, and the step would hang or
look like a lost executor. The sender fails the step instead, and its requests end with an
error that says why. Real processes, with a small limit set through the environment."""
from __future__ import annotations

import time

import httpx
import pytest

from shared.control import ExecutorClient
from tests.cluster import Cluster
from tests.conftest import start_redis, stop_process

MODEL = "SmolLM2-135M-Instruct"
LIMIT = 4096        # bytes: a short request's plan and result take a few hundred


@pytest.fixture
def cluster(monkeypatch):
    # Every service reads the limit at import: the children inherit it.
    monkeypatch.setenv("PAGEDSERVE_MAX_MESSAGE_BYTES", str(LIMIT))
    server = start_redis()
    c = Cluster(server.url, sched_flags=["--max-num-seqs", "4"])
    try:
        c.start_all()
        yield c
    finally:
        c.stop_all()
        stop_process(server.proc)


def _complete(c: Cluster, prompt, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(c.base_url + "/v1/completions", json=body, timeout=60)


def _executor(c: Cluster) -> ExecutorClient:
    return ExecutorClient(f"127.0.0.1:{c.executors['executor'][0]}")


def _settled(executor: ExecutorClient):
    """Health once the executor has run nothing for 0.3 s (a step planned ahead, whose row
    is wasted when its request stopped in the step before, may follow a response)."""
    last = executor.health()
    while True:
        time.sleep(0.3)
        now = executor.health()
        if now.steps == last.steps:
            return now
        last = now


def test_a_plan_over_the_limit_is_not_sent_and_fails_its_request(cluster):
    executor = _executor(cluster)
    assert _complete(cluster, "Hello").status_code == 200     # a small plan goes through
    before = _settled(executor)
    # 1800 token ids of 3 bytes each in msgpack: the plan that holds them is over 4 KiB
    t0 = time.monotonic()
    r = _complete(cluster, [1000 + i for i in range(1800)])
    assert time.monotonic() - t0 < 20, "the request waited for a step that cannot come"
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert "the plan of step" in message and f"over the {LIMIT} bytes" in message, message
    assert "Traceback" not in r.text
    # It never reached the executor: no step ran, nothing was reset or lost.
    after = executor.health()
    assert (after.steps, after.instance_id, after.fence) == (
        before.steps, before.instance_id, before.fence)
    r = _complete(cluster, "Hello")
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    assert cluster.get("/health")[0] == 200


def test_a_result_over_the_limit_fails_the_step_instead_of_the_connection(cluster):
    # A short prompt's plan fits; its prompt logprobs (5 candidates for each of 300 tokens)
    # make the result several times the limit.
    t0 = time.monotonic()
    r = _complete(cluster, [1000 + i for i in range(300)], prompt_logprobs=5)
    assert time.monotonic() - t0 < 60, "the request waited for a result that cannot come"
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert "the result of step" in message and f"over the {LIMIT} bytes" in message, message
    assert "the model step failed 3 times" in message      # the retries of any failed step
    # The connection was never cut: the same executor serves the next request.
    assert _executor(cluster).health().ok
    r = _complete(cluster, "Hello")
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    assert cluster.get("/health")[0] == 200
