"""Gateway test fixtures: a private redis-server, the real tokenizer, the real app served by
uvicorn on a free port (in a thread), and a stand-in scheduler that speaks the real wire
protocol over the real Redis (reads GenerationRequests, appends RequestOutputs)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import redis
import uvicorn

from services.gateway.app import create_app
from services.launcher import free_port
from services.gateway.config import GatewayConfig
from services.gateway.limits import uvicorn_options
from shared.messages import AbortRequest, GenerationRequest, RequestOutput, SeqDelta
from shared.model_source import load_tokenizer, resolve_model
from shared.redis_keys import CONSUMER_GROUP, MSG_FIELD, RedisKeys
from shared.wire import decode, encode


class RedisProcess:
    """A private redis-server that a test may stop and start again on the same port."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not on PATH (make install sets it up)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="gw-redis-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.02)
        pytest.fail("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=10)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)


@pytest.fixture(scope="session")
def redis_proc():
    r = RedisProcess()
    r.start()
    yield r
    r.stop()
    shutil.rmtree(r.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(resolve_model())


class ServerThread:
    """The real app under uvicorn, in a thread of the test process."""

    def __init__(self, config: GatewayConfig, tokenizer) -> None:
        self.app = create_app(config, tokenizer=tokenizer)
        self.config = config
        self.url = f"http://127.0.0.1:{config.port}"
        # the gateway's own protocol and options, as `pagedserve gateway` serves it
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=config.port,
                                                    log_level="warning", access_log=False,
                                                    **uvicorn_options(config)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                pytest.fail("the gateway did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="session")
def start_gateway(redis_proc, tokenizer):
    """start_gateway(**config overrides) -> ServerThread; each gets its own key prefix."""
    servers = []

    def start(**overrides) -> ServerThread:
        cfg = GatewayConfig(port=free_port(), redis_url=redis_proc.url,
                            redis_prefix=f"gw{len(servers)}", read_block_ms=500,
                            stream_start_wait_s=0.3, queue_probe_s=0.0)
        for k, v in overrides.items():
            setattr(cfg, k, v)
        servers.append(ServerThread(cfg, tokenizer))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def gateway(start_gateway):
    """The default gateway (no API keys, default limits)."""
    return start_gateway()


@pytest.fixture(scope="session")
def http(gateway):
    with httpx.Client(base_url=gateway.url, timeout=20) as c:
        yield c


@dataclass
class Taken:
    entry_id: str
    request: GenerationRequest


class FakeScheduler:
    """Plays the scheduler over real Redis, driven step by step by the test."""

    def __init__(self, url: str, prefix: str) -> None:
        self.r = redis.Redis.from_url(url, socket_timeout=10)
        self.keys = RedisKeys(prefix)
        self.name = "fake"
        try:
            self.r.xgroup_create(self.keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        # the gateway is shared by the tests of a session: skip what earlier tests left
        self.r.xgroup_setid(self.keys.requests, CONSUMER_GROUP, "$")

    def take(self, timeout: float = 10.0) -> Taken:
        reply = self.r.xreadgroup(CONSUMER_GROUP, self.name, {self.keys.requests: ">"},
                                  count=1, block=int(timeout * 1000))
        assert reply, "no request reached the queue"
        entry_id, fields = reply[0][1][0]
        return Taken(entry_id.decode(), decode(fields[MSG_FIELD], GenerationRequest))

    def emit(self, request_id: str, *seqs: SeqDelta, finished: bool = False, **kw) -> str:
        out = RequestOutput(request_id, list(seqs), finished=finished, **kw)
        return self.r.xadd(self.keys.output(request_id), {MSG_FIELD: encode(out)}).decode()

    def ack(self, taken: Taken) -> None:
        self.r.xack(self.keys.requests, CONSUMER_GROUP, taken.entry_id)

    def aborts(self) -> list[AbortRequest]:
        return [decode(f[MSG_FIELD], AbortRequest) for _id, f in self.r.xrange(self.keys.aborts)]

    def wait_abort(self, request_id: str, timeout: float = 5.0) -> float:
        """Seconds until an abort for request_id appeared; fails after timeout."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if any(a.request_id == request_id for a in self.aborts()):
                return time.monotonic() - t0
            time.sleep(0.01)
        pytest.fail(f"no abort for {request_id} within {timeout} s")

    def beat(self) -> None:
        self.r.hset(self.keys.schedulers, self.name, f"{time.time():.3f}")

    def queued(self) -> int:
        return self.r.xlen(self.keys.requests) if self.r.exists(self.keys.requests) else 0

    def serve_in_thread(self, script) -> threading.Thread:
        """Answer each request with script(request) -> list of (SeqDeltas, finished) steps."""
        def run():
            while True:
                try:
                    taken = self.take(timeout=30)
                except (AssertionError, redis.RedisError):
                    return
                if taken.request.request_id == "stop":
                    return
                for seqs, finished in script(taken.request):
                    self.emit(taken.request.request_id, *seqs, finished=finished)
                self.ack(taken)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t


@pytest.fixture
def scheduler(gateway, redis_proc):
    return FakeScheduler(redis_proc.url, gateway.config.redis_prefix)


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """Parse an SSE body into (id, data) pairs (comments skipped)."""
    events, eid, data = [], None, []
    for line in text.split("\n"):
        if line == "":
            if data:
                events.append((eid, "\n".join(data)))
            eid, data = None, []
        elif line.startswith("id: "):
            eid = line[4:]
        elif line.startswith("data: "):
            data.append(line[6:])
    return events


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
