"""Per-key budgets hold across gateway processes (two real `pagedserve gateway` processes on
one Redis), and a gateway killed -9 while holding a key's share gives it back."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from services.gateway.budgets import LEASE_S
from services.launcher import free_port
from tests.conftest import REPO, stop_process
from tests.gateway.conftest import FakeScheduler

MODEL = "SmolLM2-135M-Instruct"
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "stream": True}
KEY = {"Authorization": "Bearer sk-one"}


def _gateway(redis_url: str, prefix: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.launcher", "gateway", "--port", str(port),
         "--redis-url", redis_url, "--redis-prefix", prefix, "--key-max-requests", "2",
         "--log-level", "warning"],
        cwd=REPO, start_new_session=True,
        env=dict(os.environ, PAGEDSERVE_API_KEYS="sk-one,sk-two"))
    return proc, f"http://127.0.0.1:{port}"


def _wait_up(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"gateway exited with {proc.returncode}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/ping", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"gateway at {url} not up after {timeout} s")


def test_a_keys_budget_is_shared_by_two_gateway_processes_and_freed_by_a_dead_one(redis_proc):
    prefix = f"shared{free_port()}"
    sched = FakeScheduler(redis_proc.url, prefix)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.5):
            sched.beat()
    sched.beat()
    threading.Thread(target=beat, daemon=True).start()
    (a, url_a), (b, url_b) = _gateway(redis_proc.url, prefix), _gateway(redis_proc.url, prefix)
    try:
        _wait_up(url_a, a)
        _wait_up(url_b, b)
        with httpx.Client(timeout=20) as c, contextlib.ExitStack() as open_:
            # one open request of the key on each gateway: the key's limit of 2 is reached
            for url in (url_a, url_b):
                r = open_.enter_context(c.stream("POST", url + "/v1/completions", json=BODY,
                                                 headers=KEY))
                assert r.status_code == 200
            for url in (url_a, url_b):
                r = open_.enter_context(c.stream("POST", url + "/v1/completions", json=BODY,
                                                 headers=KEY))
                assert r.status_code == 429, "the other gateway's request did not count"
                assert "2 requests of this API key are open" in r.read().decode()
            # another key is not touched
            r = open_.enter_context(c.stream("POST", url_a + "/v1/completions", json=BODY,
                                             headers={"Authorization": "Bearer sk-two"}))
            assert r.status_code == 200
            # gateway b dies holding one: its share comes back once its lease has run out
            os.killpg(b.pid, signal.SIGKILL)
            b.wait()
            died = time.monotonic()
            while True:
                r = c.send(c.build_request("POST", url_a + "/v1/completions", json=BODY,
                                           headers=KEY), stream=True)
                if r.status_code == 200:
                    open_.callback(r.close)
                    break
                r.close()
                assert r.status_code == 429
                assert time.monotonic() - died < LEASE_S + 5, "the dead gateway's share leaked"
                time.sleep(0.5)
            assert time.monotonic() - died > 1.0      # not at once: the lease had to run out
    finally:
        stop.set()
        for p in (a, b):
            stop_process(p, timeout=10)
