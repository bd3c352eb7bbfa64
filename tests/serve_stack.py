"""`pagedserve serve` as a user runs it (its own private Redis, its own internal ports), and
the processes it supervises, for tests that kill -9 one of them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from services.launcher import free_port
from tests.conftest import REPO, stop_process

# The four services `serve` starts, told apart by their command lines.
SERVICES = {"redis": "redis-server", "executor": "services.launcher executor",
            "scheduler": "services.launcher scheduler", "gateway": "services.launcher gateway"}
SMALL = ["--device", "cpu", "--dtype", "float32", "--kv-cache-gib", "0.25",
         "--swap-space-gib", "0.25", "--log-level", "warning"]


def child_pids(pid: int) -> list[int]:
    """PIDs of the processes `pid` started (any of its threads), from /proc."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += map(int, f.read().split())
    return out


def alive(pid: int) -> bool:
    """False once `pid` has exited (a zombie not yet reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class Serve:
    def __init__(self, *flags: str, port: int | None = None, env: dict | None = None) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "services.launcher", "serve", "--port",
                     str(self.port), *SMALL, *flags]
        self.proc = subprocess.Popen(self.argv, cwd=REPO, start_new_session=True,
                                     env=dict(os.environ, **(env or {})),
                                     stderr=subprocess.PIPE, text=True)

    def wait_healthy(self, timeout: float = 300) -> "Serve":
        deadline = time.monotonic() + timeout
        while self.health()[0] != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}: "
                                   f"{self.proc.stderr.read()}")
            assert time.monotonic() < deadline, f"serve not healthy after {timeout} s"
            time.sleep(0.2)
        return self

    def children(self) -> dict[str, int]:
        """service name -> pid of the process `serve` runs for it now."""
        out = {}
        for pid in child_pids(self.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as c:
                    cmd = c.read().replace(b"\0", b" ").decode()
            except (FileNotFoundError, ProcessLookupError):   # it exited meanwhile
                continue
            for name, mark in SERVICES.items():
                if mark in cmd:
                    out[name] = pid
        return out

    def kill(self, name: str) -> int:
        """kill -9 of one service (and whatever runs in its process group)."""
        pid = self.children()[name]
        os.killpg(pid, signal.SIGKILL)
        return pid

    def health(self) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=3) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError as e:
            return 0, str(e)

    def stop(self) -> None:
        stop_process(self.proc, timeout=30)
