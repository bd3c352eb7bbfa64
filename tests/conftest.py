"""Fixtures that start real services: a private redis-server, and the whole stack.

The stack is the real thing: `pagedserve serve` as a subprocess (executor, scheduler and
gateway as separate processes) against the test's own Redis, on free ports, with the
bundled SmolLM2-135M-Instruct on the CPU.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

import pytest
import redis

from services.launcher import free_port, free_ports  # noqa: F401 (tests import them from here)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class RedisServer:
    url: str
    port: int
    proc: subprocess.Popen
    dir: str

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


def start_redis(port: int | None = None) -> RedisServer:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not on PATH (make install sets it up)")
    port = port or free_port()
    d = tempfile.mkdtemp(prefix="ps-redis-")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", d, "--loglevel", "warning"],
                            stdout=subprocess.DEVNULL)
    server = RedisServer(f"redis://127.0.0.1:{port}/0", port, proc, d)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if server.client().ping():
                return server
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    pytest.fail("redis-server did not start")


def stop_process(proc: subprocess.Popen, timeout: float = 15) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def redis_server():
    server = start_redis()
    yield server
    stop_process(server.proc)
    shutil.rmtree(server.dir, ignore_errors=True)


def metric_value(exposition: str, name: str) -> float:
    """The summed value of one metric family (all label sets) in Prometheus text."""
    total, found = 0.0, False
    for line in exposition.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(name)
    return total


@dataclass
class Stack:
    base_url: str
    api_key: str | None
    redis_url: str
    proc: subprocess.Popen
    ports: dict

    def metrics(self) -> str:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str) -> float:
        return metric_value(self.metrics(), name)


def start_stack(redis_url: str, *extra: str, api_key: str | None = None,
                timeout: float = 600, tensor_parallel_size: int = 1) -> Stack:
    tp = tensor_parallel_size
    # gRPC on grpc + rank; results on zmq, plans on zmq + 1 + rank
    ports = {"http": free_port(), "grpc": free_ports(tp), "zmq": free_ports(tp + 1),
             "dist": free_port()}
    argv = [sys.executable, "-m", "services.launcher", "serve",
            "--redis-url", redis_url, "--port", str(ports["http"]),
            "--grpc-port", str(ports["grpc"]), "--zmq-port", str(ports["zmq"]),
            "--tensor-parallel-size", str(tp), "--dist-port", str(ports["dist"]),
            "--redis-prefix", f"t{ports['http']}", "--device", "cpu", "--dtype", "float32",
            "--kv-cache-gib", "0.25", "--swap-space-gib", "0.25", "--log-level", "warning",
            *extra]
    if api_key:
        argv += ["--api-keys", api_key]
    proc = subprocess.Popen(argv, cwd=REPO, start_new_session=True)
    url = f"http://127.0.0.1:{ports['http']}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"pagedserve serve exited with {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return Stack(url, api_key, redis_url, proc, ports)
        except Exception:
            time.sleep(0.3)
    stop_process(proc)
    pytest.fail("the stack did not become healthy in time")


@pytest.fixture(scope="session")
def stack(redis_server):
    s = start_stack(redis_server.url)
    yield s
    stop_process(s.proc, timeout=20)
