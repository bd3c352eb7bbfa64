"""`pagedserve gateway --api-server-count N`: N processes listen on one port, each streams
its own clients' outputs, and the group ends as one when a server dies."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from services.gateway.servers import api_server_count
from shared.messages import SeqDelta
from tests.conftest import REPO, free_port, stop_process
from tests.gateway.conftest import FakeScheduler

PREFIX = "servers"


def _listeners(pid: int, port: int) -> int:
    """How many LISTEN sockets on `port` process `pid` holds."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                    inodes.add(cols[9])
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            held.add(target[8:-1])
    return len(inodes & held)


def _servers(pid: int, port: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(x) for x in f.read().split()]
    return [k for k in kids if _listeners(k, port)]


def test_auto_count_leaves_small_machines_one_process():
    assert api_server_count(3) == 3
    assert 1 <= api_server_count(0) <= 8
    assert api_server_count(0) == max(1, min(8, (os.cpu_count() or 1) // 4))


def test_two_servers_share_the_port_stream_their_clients_and_end_together(redis_proc):
    port = free_port()
    gw = subprocess.Popen(
        [sys.executable, "-m", "services.launcher", "gateway", "--port", str(port),
         "--redis-url", redis_proc.url, "--redis-prefix", PREFIX, "--api-server-count", "2",
         "--log-level", "warning"], cwd=REPO, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        servers: list[int] = []
        deadline = time.monotonic() + 120
        while len(servers) < 2 and time.monotonic() < deadline:
            assert gw.poll() is None, "the gateway group exited during start-up"
            servers = _servers(gw.pid, port)
            time.sleep(0.3)
        assert len(servers) == 2, "two server processes, each listening on the one port"
        assert _listeners(gw.pid, port) == 0, "the supervisor itself does not accept"
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/ping", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)

        sched = FakeScheduler(redis_proc.url, PREFIX)
        sched.beat()
        sched.serve_in_thread(lambda req: [([SeqDelta(0, [28 + k])], False) for k in range(4)]
                              + [([SeqDelta(0, [40], finish_reason="length")], True)])

        def stream(i: int) -> str:
            # a new connection each: the kernel spreads them over both servers
            with httpx.Client(base_url=base, timeout=30) as c:
                with c.stream("POST", "/v1/completions", json={
                        "prompt": f"hi {i}", "max_tokens": 5, "stream": True}) as r:
                    assert r.status_code == 200
                    texts = [json.loads(line[6:])["choices"][0]["text"]
                             for line in r.iter_lines() if line.startswith("data: {")]
            return "".join(texts)

        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(stream, range(8)))
        assert texts[0] and texts == [texts[0]] * 8, texts

        os.kill(servers[0], signal.SIGKILL)
        gw.wait(timeout=30)           # one server died: the supervisor ends the group

        def all_gone() -> bool:
            return all(not os.path.exists(f"/proc/{s}") or _zombie(s) for s in servers)
        deadline = time.monotonic() + 10
        while not all_gone() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all_gone(), "a server outlived its supervisor"
    finally:
        stop_process(gw)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture(autouse=True)
def _no_leftover_group(redis_proc):
    yield
    r = redis_proc.client()
    for key in r.scan_iter(f"{PREFIX}:*"):
        r.delete(key)
