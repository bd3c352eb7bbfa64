"""The launcher's command line: environment variables, and their errors."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from services.launcher import (Stack, _ephemeral_range, _reserve, build_parser, free_port,
                               free_ports)
from tests.conftest import REPO
from tests.serve_stack import SMALL, alive, child_pids


def launch(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.launcher", *argv], cwd=REPO,
                          env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("var, value, kind, argv", [
    ("PAGEDSERVE_PORT", "abc", "an integer", ["serve"]),
    ("PAGEDSERVE_PORT", "80.5", "an integer", ["gateway"]),
    ("PAGEDSERVE_KV_CACHE_GIB", "lots", "a number", ["executor"]),
    ("PAGEDSERVE_MAX_NUM_SEQS", "many", "an integer", ["scheduler"]),
    ("PAGEDSERVE_API_SERVER_COUNT", "-1", "an integer >= 0", ["gateway"]),
    ("PAGEDSERVE_GRPC_PORT", "123456", "a port (0 to 65535)", ["executor"]),
    ("PAGEDSERVE_LOG_LEVEL", "loud", "one of debug, info, warning, error, critical",
     ["gateway"]),
])
def test_malformed_env_value_is_one_line_naming_it_with_status_2(var, value, kind, argv):
    done = launch(*argv, **{var: value})
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"{var}={value!r}" in lines[0] and f"is not {kind}" in lines[0]
    assert lines[0].startswith(f"pagedserve {argv[0]}: error: ")


@pytest.mark.parametrize("argv, message", [
    (["scheduler", "--preemption-mode", "sometimes"], "preemption_mode must be one of"),
    (["scheduler", "--async-scheduling", "maybe"], "async_scheduling must be auto, on or off"),
    (["serve", "--policy", "lifo"], "policy must be one of"),
    (["serve", "--async-scheduling", "maybe"], "async_scheduling must be auto, on or off"),
    (["serve", "--max-queue", "0"], "--max-queue must be >= 1, got 0"),
    (["serve", "--limit-concurrency", "-1"], "--limit-concurrency must be >= 1, got -1"),
    (["serve", "--send-timeout-s", "0"], "--send-timeout-s must be > 0, got 0.0"),
    (["serve", "--key-max-tokens", "-5"], "--key-max-tokens must be >= 0, got -5"),
    (["gateway", "--resume-grace-s", "-1"], "--resume-grace-s must be >= 0, got -1.0"),
    (["gateway", "--port", "70000"], "--port must be at most 65535, got 70000"),
])
def test_a_bad_setting_is_one_line_with_status_2_before_anything_starts(argv, message):
    done = launch(*argv)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert lines[0].startswith("pagedserve: " if argv[0] == "serve"
                               else f"pagedserve {argv[0]}: ")


def test_an_executor_whose_kv_cache_does_not_fit_the_host_ends_in_one_line():
    """`--kv-cache-gib` beyond the host's memory: one line naming the sizes, status 2 (the
    allocation was a torch traceback)."""
    done = launch("executor", "--kv-cache-gib", "100000", "--log-level", "warning")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("pagedserve executor: the KV cache (100000.0 GiB on cpu"), line
    assert "GiB is available: lower kv_cache_gib or swap_space_gib" in line


@pytest.mark.parametrize("flag", ["--metrics-port", "--grpc-port", "--zmq-port",
                                  "--dist-port"])
def test_a_port_flag_past_65535_is_refused_by_argparse(flag):
    """(Each was a traceback: OverflowError from bind in the service or in serve's check.)"""
    done = launch("serve", flag, "99999")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"argument {flag}: invalid port value: '99999'" in done.stderr


def test_a_zmq_port_whose_span_passes_65535_is_one_line():
    """--zmq-port takes 2 + tensor-parallel-size ports from the one given."""
    done = launch("serve", "--zmq-port", "65535", "--port", str(free_port()))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "pagedserve: --zmq-port 65535 takes 3 ports from there (up to 65537): pick at most "
        "65533"], done.stderr


@pytest.mark.parametrize("argv, line", [
    (["--redis-url", "redis://127.0.0.1:1/0"],
     "pagedserve: Redis at 127.0.0.1:1/0 does not answer (ConnectionError: "),
    (["--redis-url", "notaurl"],
     "pagedserve: the Redis URL (--redis-url or REDIS_URL) cannot be used: "),
    (["--host", "999.1.1.1"], "pagedserve: --host '999.1.1.1' is no address ("),
    (["--bind-host", "nonsense.invalid"], "pagedserve: --bind-host 'nonsense.invalid' is no "
                                          "address ("),
])
def test_serve_refuses_a_redis_or_an_address_it_cannot_use_in_one_line(argv, line):
    """Each was a traceback from the scheduler or the executor once started (or, for an
    address, 'port(s) in use')."""
    done = launch("serve", "--port", str(free_port()), *argv)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), done.stderr


@pytest.mark.parametrize("argv, line", [
    (["gateway", "--host", "999.1.1.1"], "pagedserve gateway: --host '999.1.1.1' is no address ("),
    (["executor", "--bind-host", "nonsense.invalid"],
     "pagedserve executor: --bind-host 'nonsense.invalid' is no address ("),
    (["scheduler", "--metrics-port", "18999", "--metrics-host", "nonsense.invalid"],
     "pagedserve scheduler: --metrics-host 'nonsense.invalid' is no address ("),
])
def test_a_service_refuses_an_address_it_cannot_listen_on_in_one_line(argv, line):
    done = launch(*argv)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), done.stderr


def test_a_bad_log_level_is_refused_by_argparse():
    done = launch("serve", "--log-level", "loud")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "argument --log-level: invalid log_level value: 'loud'" in done.stderr
    assert build_parser().parse_args(["gateway", "--log-level", "WARNING"]).log_level == "warning"


def test_a_scheduler_started_before_its_redis_waits_for_it_and_stops_on_sigterm():
    """(It ended in a traceback at its first Redis call.)"""
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher", "scheduler",
                             "--redis-url", f"redis://127.0.0.1:{free_port()}/0"],
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        while line and "does not answer" not in line:
            line = proc.stderr.readline()
        assert "WARNING Redis at 127.0.0.1:" in line and "waiting for it" in line, line
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_flag_wins_over_a_malformed_env_value(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_PORT", "abc")
    assert build_parser().parse_args(["gateway", "--port", "8123"]).port == 8123


def test_a_malformed_env_value_only_stops_the_commands_that_read_it(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_PORT", "abc")          # the gateway's port
    assert build_parser().parse_args(["executor"]).grpc_port == 50051


def test_well_formed_env_values_arrive_typed(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_PORT", "8123")
    monkeypatch.setenv("PAGEDSERVE_KV_CACHE_GIB", "0.5")
    args = build_parser().parse_args(["serve"])
    assert args.port == 8123 and type(args.port) is int
    assert args.kv_cache_gib == 0.5 and type(args.kv_cache_gib) is float


def test_a_malformed_flag_keeps_argparse_own_message():
    done = launch("gateway", "--port", "x")
    assert done.returncode == 2
    assert "argument --port: invalid int value: 'x'" in done.stderr


def test_a_negative_api_server_count_is_refused_before_anything_starts():
    """`--api-server-count` counts processes: 0 sizes it to the cores, below 0 is an error
    (it was taken as 0)."""
    done = launch("serve", "--api-server-count", "-2")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "argument --api-server-count: invalid count value: '-2'" in done.stderr
    assert build_parser().parse_args(["gateway", "--api-server-count", "0"]).api_server_count == 0


def test_served_model_names_and_the_resume_grace_reach_the_gateway(monkeypatch):
    from services.launcher import _flags_for, gateway_config

    args = build_parser().parse_args(["serve", "--served-model-name", "team", "gpt-x,alias",
                                      "--resume-grace-s", "5"])
    cfg = gateway_config(args)
    assert (cfg.served_model_name, cfg.resume_grace_s) == (["team", "gpt-x", "alias"], 5.0)
    # `serve` hands both on to the gateway process it starts
    again = build_parser().parse_args(["gateway", *_flags_for(args)["gateway"]])
    assert gateway_config(again).served_model_name == ["team", "gpt-x", "alias"]
    monkeypatch.setenv("PAGEDSERVE_SERVED_MODEL_NAME", "a,b")
    monkeypatch.setenv("PAGEDSERVE_RESUME_GRACE_S", "7.5")
    cfg = gateway_config(build_parser().parse_args(["gateway"]))
    assert (cfg.served_model_name, cfg.resume_grace_s) == (["a", "b"], 7.5)


def test_free_ports_lie_below_the_ephemeral_range():
    # An ephemeral port can be taken by any outgoing connection before a service binds it.
    low, _high = _ephemeral_range()
    ports = [free_ports(3) for _ in range(50)]
    assert all(p + 2 < low for p in ports), ports
    assert len(set(ports)) == len(ports)


def test_a_port_claimed_by_another_process_is_not_handed_out_until_it_exits():
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from services.launcher import free_port; "
         "print(free_port(), flush=True); sys.stdin.read()"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        assert not _reserve(port)        # the port is free to bind, but claimed
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert _reserve(port)                # the claim ended with its process


def _commands(buf: bytes) -> tuple[list[bytes], bytes]:
    """The names of the whole RESP commands at the start of `buf`, and what is left."""
    names = []
    while buf.startswith(b"*"):
        head, sep, rest = buf.partition(b"\r\n")
        if not sep:
            break
        args = []
        for _ in range(int(head[1:])):
            size, sep, rest = rest.partition(b"\r\n")
            if not sep or len(rest) < int(size[1:]) + 2:
                return names, buf              # the rest of this command has not come yet
            args.append(rest[:int(size[1:])])
            rest = rest[int(size[1:]) + 2:]
        names.append(args[0].upper() if args else b"")
        buf = rest
    return names, buf


def _old_redis() -> tuple[socket.socket, threading.Thread]:
    """A server that speaks enough RESP to say it is Redis 6.2 (INFO), and OK to the rest:
    one reply per whole command, however the client's bytes arrive, one thread per client."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    info = b"# Server\r\nredis_version:6.2.14\r\n"

    def client(conn: socket.socket) -> None:
        with conn:
            buf = b""
            while chunk := conn.recv(4096):
                names, buf = _commands(buf + chunk)
                for name in names:
                    if name == b"INFO":
                        conn.sendall(b"$%d\r\n%s\r\n" % (len(info), info))
                    elif name == b"HELLO":
                        conn.sendall(b"%1\r\n+proto\r\n:3\r\n")   # RESP3
                    else:
                        conn.sendall(b"+OK\r\n")

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=client, args=(conn,), daemon=True).start()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


@pytest.mark.parametrize("service", ["scheduler", "gateway"])
def test_a_redis_older_than_7_is_refused_in_one_line(service):
    srv, _ = _old_redis()
    port = srv.getsockname()[1]
    try:
        done = subprocess.run([sys.executable, "-m", "services.launcher", service, "--redis-url",
                               f"redis://127.0.0.1:{port}/0"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
    finally:
        srv.close()
    assert done.returncode == 2
    assert done.stderr.strip() == (f"pagedserve {service}: Redis 6.2.14 at 127.0.0.1:{port}/0 "
                                   "is too old: pagedserve needs Redis 7 or newer")


def test_the_redis_password_comes_from_the_environment_into_the_url(monkeypatch):
    from services.launcher import with_password
    monkeypatch.setenv("PAGEDSERVE_REDIS_PASSWORD", "p@ss/word")
    assert with_password("redis://redis:6379/0") == "redis://:p%40ss%2Fword@redis:6379/0"
    assert with_password("redis://:other@redis:6379/0") == "redis://:other@redis:6379/0"
    monkeypatch.delenv("PAGEDSERVE_REDIS_PASSWORD")
    assert with_password("redis://redis:6379/0") == "redis://redis:6379/0"


@pytest.mark.parametrize("given, expected", [({}, "PASSIVE 10000"),
                                             ({"GOMP_SPINCOUNT": "1000"}, "PASSIVE 1000"),
                                             ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE 10000")])
def test_the_executors_openmp_spin_is_documented_default_unless_the_environment_sets_it(
        given, expected):
    # (docs/overhead.md: 10,000 spins before sleeping; a shared host sets fewer)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = ("import os; from services.launcher import executor_openmp_defaults as d; d(); "
            "print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**env, **given},
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == expected, done.stderr


def test_serve_started_with_sigint_ignored_stops_on_sigint():
    """A shell starts `pagedserve serve &` with SIGINT ignored; `kill -INT` still stops it and
    everything it started."""
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher", "serve", "--port",
                             str(free_port()), *SMALL], cwd=REPO, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (started := child_pids(proc.pid)):     # its Redis, at least, runs
            assert proc.poll() is None and time.monotonic() < deadline, "serve started nothing"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "shutting down" in proc.stderr.read()
        assert [pid for pid in started if alive(pid)] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_start_up_ends_at_once_when_a_service_starting_beside_it_exits():
    """serve starts the gateway while the executor loads: a gateway that exits then is
    reported while serve still waits for the executor, not once the executor is up."""
    stack = Stack(build_parser().parse_args(["serve"]))
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    loading = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="gateway exited with status 3 during start-up"):
            stack._wait("executor", loading, lambda: False, 30, also=[("gateway", dead)])
        assert time.monotonic() - t0 < 5
    finally:
        loading.kill()
        loading.wait()
        stack.stop()


def test_a_port_whose_server_just_exited_is_free_while_a_listener_makes_it_taken():
    """A server that closed its connections first leaves them on its port (FIN-WAIT-2,
    TIME-WAIT) for a minute after it stops listening: the launcher's check must not call
    that port in use (a `serve` right after the last one stopped), but a live listener is."""
    from services.launcher import _port_free

    port = free_port()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen()
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    assert not _port_free("127.0.0.1", port)            # listening
    conn.close()                                         # the server closes first
    srv.close()
    plain = socket.socket()        # the connection lingers: a plain bind is refused
    with pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))
    plain.close()
    assert _port_free("127.0.0.1", port)
    assert _port_free("0.0.0.0", port)
    client.close()
