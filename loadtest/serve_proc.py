"""`pagedserve serve` as a benchmark's child process: started from a given tree as a user
starts it, waited on until healthy, stopped with its whole process group."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SERVICES = ("executor", "scheduler", "gateway")


def start(tree: Path, port: int, flags: list[str], env: dict | None = None
          ) -> subprocess.Popen:
    """`python -m services.launcher serve --port PORT *flags` run from `tree` (its own code
    first on the path); its banner is not the benchmark's output, its errors go to a
    temporary file (a pipe nobody reads during a long run could fill and block it)."""
    env = dict(os.environ if env is None else env, PYTHONPATH=str(tree))
    argv = [sys.executable, "-m", "services.launcher", "serve", "--port", str(port), *flags]
    errors = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, cwd=tree, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=errors)
    proc.errors = errors
    return proc


def _errors(proc: subprocess.Popen) -> str:
    proc.errors.seek(0)
    return proc.errors.read().decode(errors="replace")[-2000:]


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 600) -> float:
    """Seconds until the first 200 of /health (polled every 50 ms). Exits with serve's
    error when it stops first, or after `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode} during start-up: "
                             f"{_errors(proc)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except Exception:
            time.sleep(0.05)
    raise SystemExit(f"serve was not healthy after {timeout:g} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to serve's process group, SIGKILL after 30 s."""
    proc.errors.close()
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def service_pids() -> dict[str, list[tuple[int, list[str]]]]:
    """role ("executor", "scheduler", "gateway") -> (pid, command line) of every pagedserve
    service process on this host, read from /proc."""
    found: dict[str, list] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "services.launcher" in argv:
            role = argv[argv.index("services.launcher") + 1:][:1]
            if role and role[0] in SERVICES:
                found.setdefault(role[0], []).append((int(pid), argv))
    return found
