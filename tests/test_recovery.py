"""A crash is invisible to the client, under `pagedserve serve` as a user starts it.

kill -9 of the executor or of the scheduler while requests stream and others queue: `serve`
restarts the service, every request completes, and greedy output is token-identical to the
same requests on the same stack with no crash. kill -9 of its Redis: requests may fail fast
(503) while it is down, none hangs, and the stack serves again on its own. The 16 + 16
version of these runs is loadtest/bench_crash.py (figures in docs/reliability.md)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from shared.control import ExecutorClient
from tests.conftest import REPO, free_port, free_ports
from tests.serve_stack import SERVICES, Serve
from tests.test_faults import MODEL, Outcome, launch, stream, wait_until

RUNNING = 4                      # --max-num-seqs: as many stream while as many queue
PROMPTS = [f"Story number {i}: once upon a time" for i in range(2 * RUNNING)]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def serve():
    s = Serve("--max-num-seqs", str(RUNNING)).wait_healthy()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(serve):
    outs, threads = launch(serve.base_url, PROMPTS, NEW_TOKENS)
    for t in threads:
        t.join(timeout=300)
    assert all(o.error is None and o.usage_tokens == NEW_TOKENS for o in outs), \
        [o.error for o in outs]
    return [o.text for o in outs]


def run_with_kill(serve: Serve, name: str) -> list[Outcome]:
    outs, threads = launch(serve.base_url, PROMPTS, NEW_TOKENS)
    # kill while RUNNING requests stream (a few tokens in) and the rest still queue
    wait_until("two requests stream", lambda: sum(o.tokens >= 3 for o in outs) >= 2, 120)
    before = serve.children()[name]
    serve.kill(name)
    wait_until(f"serve restarts the {name}",
               lambda: serve.children().get(name, before) != before, 30)
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), f"a request hung after the {name} restart"
    return outs


@pytest.mark.parametrize("name", ["executor", "scheduler"])
def test_kill_9_is_invisible_to_the_client(serve, reference, name):
    outs = run_with_kill(serve, name)
    assert [o.error for o in outs] == [None] * len(PROMPTS)
    assert [o.usage_tokens for o in outs] == [NEW_TOKENS] * len(PROMPTS)
    assert [o.finish for o in outs] == ["length"] * len(PROMPTS)
    assert [o.text for o in outs] == reference
    wait_until("/health is 200 again", lambda: serve.health()[0] == 200, 60)


def test_redis_kill_9_fails_fast_then_serves_again(serve, reference):
    outs, threads = launch(serve.base_url, PROMPTS, NEW_TOKENS)
    wait_until("two requests stream", lambda: sum(o.tokens >= 3 for o in outs) >= 2, 120)
    killed = time.monotonic()
    serve.kill("redis")
    # while it is down (serve restarts it after 1 s), a new request is refused at once
    r = httpx.post(serve.base_url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
    assert r.status_code in (200, 503), r.text
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a request hung after Redis died"
    for o, ref in zip(outs, reference):
        # a request either completes correctly or ends with an explicit error
        assert (o.error is None and o.text == ref) or o.error, (o.error, o.text)
    wait_until("/health is 200 again", lambda: serve.health()[0] == 200, 60)
    again = Outcome()
    stream(serve.base_url, PROMPTS[0], NEW_TOKENS, again)
    assert again.error is None and again.text == reference[0]
    assert again.ended_at - killed < 120


def test_an_explicit_port_in_use_is_refused_in_one_line_before_anything_starts():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "services.launcher", "serve",
                               "--grpc-port", str(taken), "--port", "1"], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--grpc-port {taken}" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("service", ["serve", "gateway", "executor"])
@pytest.mark.parametrize("model", ["missing.gguf", "not_gguf.gguf", "empty_folder"])
def test_a_model_that_is_missing_or_not_a_model_is_refused_in_one_line(tmp_path, service,
                                                                       model):
    """`serve`, and a gateway or executor started alone, say in one line that --model is
    missing or is no GGUF file (nothing started, no traceback), before loading anything."""
    (tmp_path / "not_gguf.gguf").write_text("hello")
    (tmp_path / "empty_folder").mkdir()
    path = tmp_path / model
    done = subprocess.run([sys.executable, "-m", "services.launcher", service, "--model",
                           str(path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0], done.stderr
    assert ("not a GGUF file" if model == "not_gguf.gguf" else "not found") in lines[0]
    assert lines[0].startswith("pagedserve" + ("" if service == "serve" else f" {service}"))


def _damaged_gguf(folder):
    path = folder / "damaged.gguf"       # the magic bytes and version, then a cut-off header
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x05" * 21)
    return path


@pytest.mark.parametrize("service", ["gateway", "executor"])
def test_a_damaged_gguf_is_refused_in_one_line(tmp_path, service):
    """A .gguf with the right magic bytes and a cut-off header: the gateway (its tokenizer)
    and the executor (its weights) each say in one line that it cannot be read."""
    path = _damaged_gguf(tmp_path)
    done = subprocess.run([sys.executable, "-m", "services.launcher", service, "--model",
                           str(path), "--log-level", "warning"], cwd=REPO, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"pagedserve {service}: model {str(path)!r} cannot be read")


def test_serve_with_a_damaged_gguf_stops_with_the_reason_and_no_traceback(tmp_path,
                                                                          redis_server):
    """Through `pagedserve serve`: the stack stops at start-up, saying why in a line of
    its own, and no traceback reaches the terminal."""
    path = _damaged_gguf(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "services.launcher", "serve", "--model", str(path),
         "--redis-url", redis_server.url, "--port", str(free_port()),
         "--grpc-port", str(free_port()), "--zmq-port", str(free_ports(2)),
         "--redis-prefix", f"dmg{os.getpid()}", "--log-level", "warning"],
        cwd=REPO, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    # the gateway (its tokenizer) and the executor (its weights) read the file side by
    # side: whichever ends first stops the stack
    first = re.search(r"pagedserve: (gateway|executor) exited with status 2 during start-up",
                      done.stderr)
    assert first, done.stderr
    assert (f"pagedserve {first.group(1)}: model {str(path)!r} cannot be read"
            in done.stderr), done.stderr


def test_sigterm_stops_every_child_and_no_secret_is_on_a_command_line():
    """API keys and the control token reach the services in their environment only."""
    s = Serve("--max-num-seqs", "2", env={"PAGEDSERVE_API_KEYS": "sk-secret-test"})
    try:
        s.wait_healthy()
        children = s.children()
        assert set(children) == set(SERVICES)
        token = _environ(children["executor"])["PAGEDSERVE_CONTROL_TOKEN"]
        assert len(token) >= 32 and _environ(children["scheduler"])[
            "PAGEDSERVE_CONTROL_TOKEN"] == token           # made by serve, one per stack
        for pid in [s.proc.pid, *children.values()]:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            assert b"sk-secret-test" not in cmdline and token.encode() not in cmdline
        r = httpx.get(s.base_url + "/v1/models", timeout=10)
        assert r.status_code == 401             # the key reached the gateway all the same
        # the executor's control calls need the token: a caller without it cannot take over
        with open(f"/proc/{children['executor']}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        executor = ExecutorClient(f"127.0.0.1:{argv[argv.index('--grpc-port') + 1]}", token="")
        with pytest.raises(grpc.RpcError) as refused:
            executor.reset(owner="intruder")
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert executor.is_alive()                          # Health stays open
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0
        for pid in children.values():
            assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"{pid} survived"
    finally:
        s.stop()


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split("=", 1) for kv in f.read().decode().split("\0") if "=" in kv)


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"
