"""Clients that hold connections without using them are cut off, on real sockets against the
gateway process as `pagedserve gateway` runs it (its uvicorn options included): headers
trickled (slowloris), a body never finished, and 200 streams whose clients never read."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from services.launcher import free_port
from shared.messages import GenerationRequest, RequestOutput, SeqDelta
from shared.redis_keys import CONSUMER_GROUP, MSG_FIELD
from shared.wire import decode, encode
from tests.conftest import REPO, stop_process
from tests.gateway.conftest import FakeScheduler

MODEL = "SmolLM2-135M-Instruct"
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, SEND_TIMEOUT_S = 1.0, 1.0, 20.0
TOKEN = 28                       # any token id: the text is not the point
WIDE = 46778                     # the model's longest token: a newline and 80 spaces


@pytest.fixture(scope="module")
def gateway_proc(redis_proc):
    port, prefix = free_port(), f"conn{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.gateway.app", "--port", str(port),
         "--redis-url", redis_proc.url, "--redis-prefix", prefix, "--log-level", "warning",
         "--read-block-ms", "500", "--queue-probe-s", "0",
         "--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S),
         "--send-timeout-s", str(SEND_TIMEOUT_S), "--send-buffer-bytes", "16384"],
        cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/ping", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "gateway did not start"
        time.sleep(0.2)
    sched = FakeScheduler(redis_proc.url, prefix)
    sched.beat()
    yield proc, port, sched
    stop_process(proc)


def _connect(port: int, rcvbuf: int = 0) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)    # before connect
    s.connect(("127.0.0.1", port))
    return s


def _cut_within(s: socket.socket, seconds: float) -> float:
    """Seconds until the server ends the connection (EOF or reset), reading what it sent."""
    t0 = time.monotonic()
    s.settimeout(seconds)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        pytest.fail(f"the connection was still open after {seconds} s")
    return time.monotonic() - t0


def test_slowloris_headers_and_a_silent_connection_are_cut(gateway_proc):
    _proc, port, _sched = gateway_proc
    t0 = time.monotonic()       # before the connection: the server's deadline starts later
    silent = _connect(port)
    slow = _connect(port)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    stop = threading.Event()

    def trickle():          # one header byte every 0.2 s: never a complete request
        try:
            while not stop.wait(0.2):
                slow.sendall(b"X")
        except OSError:
            pass
    threading.Thread(target=trickle, daemon=True).start()
    try:
        # The trickle would keep a per-byte idle timer alive forever, so being cut at all
        # proves a deadline on the whole header; a loaded machine may cut late, never early.
        _cut_within(slow, HEADER_TIMEOUT_S * 10)
        assert time.monotonic() - t0 >= HEADER_TIMEOUT_S - 0.05    # timer granularity
        _cut_within(silent, 5)
        # a well-behaved client is served meanwhile, and after
        assert httpx.get(f"http://127.0.0.1:{port}/ping", timeout=5).status_code == 200
    finally:
        stop.set()
        slow.close()
        silent.close()


def test_a_body_sent_too_slowly_is_408(gateway_proc):
    _proc, port, _sched = gateway_proc
    s = _connect(port)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
              b"\r\nContent-Length: 100\r\n\r\n{\"model\":")
    s.settimeout(BODY_TIMEOUT_S + 5)
    reply = b""
    while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
        chunk = s.recv(4096)
        if not chunk:
            break
        reply += chunk
    s.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:200]
    assert json.loads(body)["error"]["code"] == "request_timeout"


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _settle(pid: int, timeout: float = 20.0) -> None:
    """Wait until the process uses under 10 % of a core over half a second."""
    def cpu_s() -> float:
        with open(f"/proc/{pid}/stat") as f:
            utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
        return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + timeout
    last = cpu_s()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = cpu_s()
        if now - last < 0.05:
            return
        last = now
    pytest.fail(f"the gateway kept busy for {timeout} s")


def _in_flight(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("pagedserve:gateway_requests_in_flight"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no in-flight gauge")


def test_200_clients_that_never_read_are_reaped_and_others_are_served(gateway_proc):
    proc, port, sched = gateway_proc
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1024, "stream": True,
                       "ignore_eos": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    rss_before = _rss_mib(proc.pid)
    sched.beat()
    stuck = []
    for _ in range(200):
        s = _connect(port, rcvbuf=2048)
        s.sendall(request)
        stuck.append(s)                              # and never read
    ids = []
    deadline = time.monotonic() + 60
    while len(ids) < 200 and time.monotonic() < deadline:
        got = sched.r.xreadgroup(CONSUMER_GROUP, sched.name, {sched.keys.requests: ">"},
                                 count=200, block=1000)
        ids += [decode(f[MSG_FIELD], GenerationRequest).request_id for _, f in got[0][1]
                ] if got else []
    assert len(ids) == 200, f"{len(ids)} of 200 requests reached the queue"
    # each stream gets ~200 KB of events, more than its socket's buffers and the gateway's
    # write buffer hold
    pipe = sched.r.pipeline(transaction=False)
    for rid in ids:
        for _ in range(40):
            out = RequestOutput(rid, [SeqDelta(0, [WIDE] * 64)])
            pipe.xadd(sched.keys.output(rid), {MSG_FIELD: encode(out)})
    pipe.execute()
    t_full = time.monotonic()

    # once their buffers are full the stuck streams cost the gateway no CPU ...
    _settle(proc.pid)
    assert time.monotonic() - t_full < SEND_TIMEOUT_S - 3, "the test's timing cannot hold"
    # ... and another client is served while they are stuck
    sched.beat()
    sched.serve_in_thread(lambda req: [([SeqDelta(0, [TOKEN], finish_reason="length")], True)])
    t0 = time.monotonic()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200, r.text
    # served while they are stuck, not once the send timeout reaps them
    assert time.monotonic() - t0 < SEND_TIMEOUT_S / 4
    rss_stuck = _rss_mib(proc.pid)
    assert _in_flight(port) == 200                    # served while the 200 were stuck

    # every stuck stream is aborted and its connection dropped after the send timeout
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        aborted = {a.request_id for a in sched.aborts()}
        if aborted >= set(ids):
            break
        time.sleep(0.5)
    assert aborted >= set(ids), f"{len(set(ids) - aborted)} stuck streams were not aborted"
    assert time.monotonic() - t_full > SEND_TIMEOUT_S - 0.5
    for s in stuck:
        _cut_within(s, 10)
        s.close()
    wait = time.monotonic() + 10
    while _in_flight(port) > 0 and time.monotonic() < wait:
        time.sleep(0.2)
    assert _in_flight(port) == 0
    # what 200 stuck clients cost the gateway is bounded: buffers of 16 KiB + the transport's
    assert rss_stuck - rss_before < 150, (rss_before, rss_stuck)


def test_a_kept_alive_connection_serves_requests_longer_than_the_header_timeout(gateway_proc):
    """The header deadline covers waiting for headers only: a connection that keeps sending
    whole requests, slower in total than the deadline, is not cut."""
    _proc, port, _sched = gateway_proc
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as c:
        t0 = time.monotonic()
        while time.monotonic() - t0 < HEADER_TIMEOUT_S * 2.5:
            assert c.get("/ping").status_code == 200
            time.sleep(HEADER_TIMEOUT_S / 4)
        assert c.get("/ping").status_code == 200
        assert len(c._transport._pool.connections) == 1       # one connection all along
