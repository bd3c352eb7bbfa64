"""Start the services one by one as real processes, so a test can kill -9 and restart any."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import redis

from shared.control import ExecutorClient
from shared.redis_keys import RedisKeys
from services.launcher import free_port, free_ports
from tests.conftest import REPO, metric_value, stop_process


class Cluster:
    def __init__(self, redis_url: str, *, sched_flags=(), exec_flags=(), gateway_flags=()):
        self.redis_url = redis_url
        self.http = free_port()
        self.executors: dict[str, tuple[int, int]] = {}   # name -> (grpc port, zmq port)
        self.prefix = f"c{self.http}"
        self.keys = RedisKeys(self.prefix)
        self.sched_flags, self.exec_flags, self.gateway_flags = sched_flags, exec_flags, gateway_flags
        self.procs: dict[str, subprocess.Popen] = {}
        self.base_url = f"http://127.0.0.1:{self.http}"

    # ---------------------------------------------------------------- processes
    def _spawn(self, name: str, argv: list[str], inject: str = "") -> subprocess.Popen:
        """`inject`: Python run in the process before the service starts (a fault)."""
        common = ["--redis-url", self.redis_url, "--redis-prefix", self.prefix,
                  "--log-level", "warning"]
        entry = ["-m", "services.launcher"] if not inject else [
            "-c", inject + "\nimport sys\nfrom services.launcher import main\n"
                           "sys.exit(main(sys.argv[1:]))"]
        proc = subprocess.Popen([sys.executable, *entry, *argv, *common],
                                cwd=REPO, start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_executor(self, name: str = "executor", timeout: float = 300,
                       inject: str = "", flags: tuple[str, ...] = ()) -> None:
        """Start (or restart on the same ports) one executor; `flags` after `exec_flags`."""
        if name not in self.executors:
            self.executors[name] = (free_port(), free_ports(2))
        grpc_port, zmq_port = self.executors[name]
        self._spawn(name, ["executor", "--grpc-port", str(grpc_port), "--zmq-port",
                           str(zmq_port), "--device", "cpu", "--dtype", "float32",
                           "--kv-cache-gib", "0.25", "--swap-space-gib", "0.25",
                           *self.exec_flags, *flags], inject)
        client = ExecutorClient(f"127.0.0.1:{grpc_port}")
        self._wait(name, lambda: client.is_alive(1.0), timeout)

    def start_scheduler(self, name: str = "sched-a", executor: str = "executor",
                        timeout: float = 60) -> None:
        before = time.time()
        self._spawn(name, ["scheduler", "--executor", f"127.0.0.1:{self.executors[executor][0]}",
                           "--scheduler-name", name, *self.sched_flags])
        r = redis.Redis.from_url(self.redis_url)

        def beating():
            v = r.hget(self.keys.schedulers, name)
            return v is not None and float(v) > before
        self._wait(name, beating, timeout)

    def start_gateway(self, timeout: float = 120) -> None:
        self._spawn("gateway", ["gateway", "--port", str(self.http), *self.gateway_flags])
        self._wait("gateway", lambda: self.get("/ping")[0] == 200, timeout)

    def start_all(self) -> "Cluster":
        self.start_executor()
        self.start_scheduler()
        self.start_gateway()
        self._wait("health", lambda: self.get("/health")[0] == 200, 30)
        return self

    def kill(self, name: str) -> None:
        """kill -9: no clean-up of any kind."""
        proc = self.procs.pop(name)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            stop_process(proc, timeout=10)
        self.procs.clear()

    def _wait(self, what: str, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in list(self.procs.items()):     # other threads may start more
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}")
            try:
                if ready():
                    return
            except Exception:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{what} not ready after {timeout} s")

    # ---------------------------------------------------------------- probes
    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metric(self, name: str) -> float:
        return metric_value(self.get("/metrics")[1], name)
