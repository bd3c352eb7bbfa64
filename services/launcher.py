"""`pagedserve`: start one service, or the whole stack, from one command line.

    pagedserve serve       Redis (unless REDIS_URL is set) + executor + scheduler + gateway
    pagedserve gateway     the OpenAI-compatible HTTP front end
    pagedserve scheduler   the CPU-only engine core
    pagedserve executor    the model, KV pool and kernels (one per GPU)
    pagedserve healthcheck {gateway,scheduler,executor}   exit 0 when healthy

Every flag has an environment variable (shown in --help); flags win. Each service turns
its flags into its own typed config object; `serve` starts each service as a separate
process with the same flags, waits for each one's health, prints the URL, and stops them
all cleanly on Ctrl-C.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

log = logging.getLogger("pagedserve")

# `serve` starts its services with fork + exec while it holds gRPC channels (its health
# checks). gRPC's fork handlers then run in the child before exec, and can abort it
# ("epoll_wait: Bad file descriptor"); the children exec at once and need none of them.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

def count(raw: str) -> int:
    """A flag's value that counts something: an integer >= 0."""
    value = int(raw)
    if value < 0:
        raise ValueError(f"{raw!r} is negative")
    return value


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def log_level(raw: str) -> str:
    """A flag's value that is a logging level's name (any case)."""
    if raw.lower() not in LOG_LEVELS:
        raise ValueError(f"{raw!r} is no log level")
    return raw.lower()


def port(raw: str) -> int:
    """A flag's value that is a TCP port: an integer from 0 to 65535."""
    value = int(raw)
    if not 0 <= value <= 65535:
        raise ValueError(f"{raw!r} is no port")
    return value


# (flag, env var, default, type, help). One table, shared by `serve` and each service.
_COMMON = [
    ("--redis-url", "REDIS_URL", None, str, "Redis URL (serve: start a private redis-server if unset)"),
    ("--redis-prefix", "PAGEDSERVE_REDIS_PREFIX", "pagedserve", str, "prefix of every Redis key"),
    ("--model", "PAGEDSERVE_MODEL", "SmolLM2-135M-Instruct", str,
     "bundled model name, a .gguf file, or a Hugging Face folder"),
    ("--max-model-len", "PAGEDSERVE_MAX_MODEL_LEN", 2048, int, "context length limit (tokens)"),
    ("--log-level", "PAGEDSERVE_LOG_LEVEL", "info", log_level,
     "debug | info | warning | error | critical"),
]
_GATEWAY = [
    ("--host", "PAGEDSERVE_HOST", "127.0.0.1", str, "gateway bind address"),
    ("--port", "PAGEDSERVE_PORT", 8000, int, "gateway port"),
    ("--api-keys", "PAGEDSERVE_API_KEYS", "", str, "comma-separated Bearer keys for /v1, /tokenize, /detokenize and /dashboard (empty: open)"),
    ("--max-queue", "PAGEDSERVE_MAX_QUEUE", 1024, int,
     "unfinished requests (waiting or running, over all gateways) before 429"),
    ("--served-model-name", "PAGEDSERVE_SERVED_MODEL_NAME", None, "names",
     "names clients may pass as model (space- or comma-separated; the first is echoed)"),
    ("--resume-grace-s", "PAGEDSERVE_RESUME_GRACE_S", 30.0, float,
     "a resumable stream's request keeps running this long after its client drops"),
    ("--header-timeout-s", "PAGEDSERVE_HEADER_TIMEOUT_S", 10.0, float,
     "a connection's request headers must be complete this soon, else it is cut"),
    ("--body-timeout-s", "PAGEDSERVE_BODY_TIMEOUT_S", 30.0, float,
     "a request body must arrive this soon, else 408"),
    ("--send-timeout-s", "PAGEDSERVE_SEND_TIMEOUT_S", 30.0, float,
     "a response write blocked this long on a client that does not read cuts it"),
    ("--limit-concurrency", "PAGEDSERVE_LIMIT_CONCURRENCY", 2048, int,
     "open connections of one gateway; beyond, new requests get 503"),
    ("--key-max-requests", "PAGEDSERVE_KEY_MAX_REQUESTS", 0, int,
     "open requests of one API key (or client address) before 429 (0: no limit)"),
    ("--key-max-tokens", "PAGEDSERVE_KEY_MAX_TOKENS", 0, int,
     "tokens (prompt + max_tokens per sequence) one key's open requests may hold (0: no limit)"),
    ("--api-server-count", "PAGEDSERVE_API_SERVER_COUNT", 0, count,
     "gateway processes sharing --port (0: one per 4 cores, 1 to 8)"),
]
_SCHEDULER = [
    ("--executor", "PAGEDSERVE_EXECUTOR", "127.0.0.1:50051", str, "gRPC address of executor rank 0"),
    ("--scheduler-name", "PAGEDSERVE_SCHEDULER_NAME", None, str, "consumer name in the request group"),
    ("--metrics-port", "PAGEDSERVE_METRICS_PORT", 0, port, "scheduler's own /metrics port (0: off)"),
    ("--max-num-seqs", "PAGEDSERVE_MAX_NUM_SEQS", 256, int, "sequences per step"),
    ("--max-num-batched-tokens", "PAGEDSERVE_MAX_NUM_BATCHED_TOKENS", 2048, int, "tokens per step"),
    ("--preemption-mode", "PAGEDSERVE_PREEMPTION_MODE", "auto", str, "auto | swap | recompute"),
    ("--policy", "PAGEDSERVE_POLICY", "fcfs", str, "fcfs | priority"),
    ("--no-prefix-caching", "PAGEDSERVE_NO_PREFIX_CACHING", False, "flag", "disable prefix caching"),
    ("--async-scheduling", "PAGEDSERVE_ASYNC_SCHEDULING", "auto", str,
     "auto | on | off: plan the next step while the executor runs the current one "
     "(auto: when the executor runs on an accelerator)"),
    ("--contiguous", "PAGEDSERVE_CONTIGUOUS", False, "flag",
     "baseline: reserve max-model-len slots per request up front"),
    ("--metrics-host", "PAGEDSERVE_METRICS_HOST", "127.0.0.1", str,
     "bind address of the scheduler's own /metrics"),
]
_EXECUTOR = [
    ("--bind-host", "PAGEDSERVE_BIND_HOST", "127.0.0.1", str, "executor bind address (ZeroMQ, gRPC)"),
    ("--advertise-host", "PAGEDSERVE_ADVERTISE_HOST", None, str, "host the scheduler dials"),
    ("--grpc-port", "PAGEDSERVE_GRPC_PORT", 50051, port, "executor control port"),
    ("--zmq-port", "PAGEDSERVE_ZMQ_PORT", 5559, port, "results port; plans on +1+rank"),
    ("--device", "PAGEDSERVE_DEVICE", "auto", str, "auto | cpu | cuda"),
    ("--dtype", "PAGEDSERVE_DTYPE", "auto", str, "auto | float32 | bfloat16 | float16"),
    ("--kv-cache-dtype", "PAGEDSERVE_KV_CACHE_DTYPE", "auto", str,
     "auto (the model's dtype) | bfloat16: halves the cache of a float32 model on the CPU"),
    ("--block-size", "PAGEDSERVE_BLOCK_SIZE", 16, int, "tokens per KV block (8, 16, 32)"),
    ("--kv-cache-gib", "PAGEDSERVE_KV_CACHE_GIB", 1.0, float, "KV pool size on the CPU (GiB)"),
    ("--gpu-memory-utilization", "PAGEDSERVE_GPU_MEMORY_UTILIZATION", 0.9, float,
     "fraction of the GPU's total memory this executor may hold (weights, activations "
     "and the KV pool)"),
    ("--swap-space-gib", "PAGEDSERVE_SWAP_SPACE_GIB", 1.0, float, "CPU swap pool (GiB)"),
    ("--num-gpu-blocks", "PAGEDSERVE_NUM_GPU_BLOCKS", None, int,
     "fix the KV pool size in blocks (overrides the memory-based sizing)"),
    ("--cuda-graph-max-batch", "PAGEDSERVE_CUDA_GRAPH_MAX_BATCH", 256, int,
     "GPU decode steps of up to this many sequences replay a CUDA graph (0: eager)"),
    ("--seed", "PAGEDSERVE_SEED", 0, int, "default sampling seed"),
    ("--num-threads", "PAGEDSERVE_NUM_THREADS", 0, int,
     "CPU threads per executor rank (0: the cores shared out over the ranks and over "
     "the other executors busy on this host)"),
    ("--tensor-parallel-size", "PAGEDSERVE_TENSOR_PARALLEL_SIZE", 1, int,
     "executor ranks that split the model (tensor parallelism, one host)"),
    ("--rank", "PAGEDSERVE_RANK", None, int,
     "run only this tensor-parallel rank (unset: rank 0, which starts the others)"),
    ("--dist-port", "PAGEDSERVE_DIST_PORT", 29500, port,
     "torch.distributed rendezvous port of the executor ranks"),
]
_SERVE = [
    ("--startup-timeout", "PAGEDSERVE_STARTUP_TIMEOUT", 900.0, float, "seconds to wait for each service"),
]

_TABLES = {"gateway": [_COMMON, _GATEWAY], "scheduler": [_COMMON, _SCHEDULER],
           "executor": [_COMMON, _EXECUTOR, _SCHEDULER[4:5]],
           "serve": [_COMMON, _GATEWAY, _SCHEDULER, _EXECUTOR, _SERVE]}


def _add(parser: argparse.ArgumentParser, table) -> None:
    seen = {a.dest for a in parser._actions}
    for flag, env, default, typ, help_ in table:
        dest = flag.lstrip("-").replace("-", "_")
        if dest in seen:
            continue
        raw = os.environ.get(env)
        if typ == "flag":
            on = raw is not None and raw.lower() not in ("", "0", "false", "no")
            parser.add_argument(flag, action="store_true", default=on or default,
                                help=f"{help_} [env {env}]")
            continue
        if typ == "names":
            parser.add_argument(flag, nargs="+", default=_names([raw or ""]) or default,
                                help=f"{help_} [env {env}]")
            continue
        value = _EnvValue(raw, env) if raw not in (None, "") else default
        parser.add_argument(flag, type=_from_env_or_flag(typ, parser.prog), default=value,
                            help=f"{help_} [env {env}, default {default}]")


class _EnvValue(str):
    """A default read from an environment variable, still a string. argparse converts a
    string default with the flag's type only when the flag is absent, so a flag still wins
    over a malformed variable, and only the command that uses the variable reads it."""

    def __new__(cls, raw: str, var: str) -> "_EnvValue":
        value = super().__new__(cls, raw)
        value.var = var
        return value


_TYPE_NAMES = {int: "an integer", float: "a number", count: "an integer >= 0",
               port: "a port (0 to 65535)", log_level: f"one of {', '.join(LOG_LEVELS)}"}


def _names(values: list[str]) -> list[str]:
    """Names given as several arguments, comma-separated, or both."""
    return [n.strip() for v in values for n in v.split(",") if n.strip()]


def _from_env_or_flag(typ, prog: str):
    """typ as an argparse type. A malformed flag gets argparse's own error; a malformed
    environment variable gets one line naming it, and exit status 2 as argparse uses."""
    if typ is str:
        return str

    def convert(raw: str):
        try:
            return typ(raw)
        except ValueError:
            if not isinstance(raw, _EnvValue):
                raise
            print(f"{prog}: error: environment variable {raw.var}={str(raw)!r} is not "
                  f"{_TYPE_NAMES.get(typ, typ.__name__)}: fix or unset it", file=sys.stderr)
            raise SystemExit(2) from None

    convert.__name__ = typ.__name__     # argparse names the type in its own messages
    return convert


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, tables in _TABLES.items():
        p = sub.add_parser(name, help=f"run the {name}" if name != "serve" else "run the whole stack")
        for t in tables:
            _add(p, t)
    hc = sub.add_parser("healthcheck", help="exit 0 when a service is healthy")
    hc.add_argument("service", choices=["gateway", "scheduler", "executor"])
    for t in (_COMMON, _GATEWAY, _SCHEDULER[:2], _EXECUTOR[:4]):
        _add(hc, t)
    return parser


# ---------------------------------------------------------------- config objects

def _fill(cls, args: argparse.Namespace, **overrides):
    """Build a config dataclass from the parsed flags whose names match its fields."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    values.update({k: v for k, v in overrides.items() if k in names})
    return cls(**values)


def executor_config(args):
    from services.executor.config import ExecutorConfig
    from services.executor.service import ExecutorServiceConfig

    # dist_host keeps its loopback default: the ranks of one executor share a host (rank 0
    # starts the others), whatever address the executor serves on.
    runner = _fill(ExecutorConfig, args, max_num_batched_tokens=args.max_num_batched_tokens,
                   rank=args.rank or 0)
    return _fill(ExecutorServiceConfig, args, runner=runner)


def scheduler_config(args):
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.service import SchedulerServiceConfig

    core = _fill(SchedulerConfig, args, enable_prefix_caching=not args.no_prefix_caching)
    extra = {"core": core, "redis_url": args.redis_url or "redis://127.0.0.1:6379/0"}
    if args.scheduler_name:
        extra["name"] = args.scheduler_name
    return _fill(SchedulerServiceConfig, args, **extra)


def gateway_config(args):
    from services.gateway.config import GatewayConfig

    keys = [k for k in (args.api_keys or "").split(",") if k]
    return _fill(GatewayConfig, args, api_keys=keys,
                 served_model_name=_names(args.served_model_name or []),
                 redis_url=args.redis_url or "redis://127.0.0.1:6379/0")


# ---------------------------------------------------------------- service entry points

PRIVATE_REDIS_MAXMEMORY = "1gb"   # serve's own Redis: queued requests and TTL'd outputs
MIN_REDIS = (7, 0)     # XINFO GROUPS `lag` (the 429 back-pressure), Lua script flags


def redis_problem(url: str, must_answer: bool = False) -> str | None:
    """One line saying what is wrong with the Redis at `url`: a URL redis-py cannot read, a
    server too old, or (must_answer) one that does not answer; else None (a Redis that
    does not answer yet: the services wait for it)."""
    import redis

    from shared.redis_keys import redis_where
    where = redis_where(url)
    try:
        client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    except ValueError as exc:
        return f"the Redis URL (--redis-url or REDIS_URL) cannot be used: {exc}"
    try:
        version = client.info("server")["redis_version"]
    except redis.RedisError as exc:
        if not must_answer:
            return None
        return (f"Redis at {where} does not answer ({type(exc).__name__}: {exc}): start it, "
                f"or fix --redis-url / REDIS_URL")
    finally:
        client.close()
    if tuple(int(x) for x in str(version).split(".")[:2]) >= MIN_REDIS:
        return None
    return (f"Redis {version} at {where} is too old: pagedserve needs Redis "
            f"{MIN_REDIS[0]} or newer")


# What the executor's OpenMP runs with unless the environment says otherwise: sleep after
# GOMP_SPINCOUNT spin iterations of libgomp (see executor_openmp_defaults).
EXECUTOR_OPENMP = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}


def executor_openmp_defaults() -> None:
    """The executor's OpenMP settings, unless the environment sets them; call before torch
    loads OpenMP.

    NOTE: threads that spin without end lose their cores to any other busy process (the
    gateway, Redis, other ranks) and then every parallel region waits for the descheduled
    one: with one busy neighbour on a 2-core host, spinning decoded at 0.54x of waiting
    passively. Threads that go to sleep at once pay a wake-up at every parallel region
    instead (about 300 a decode step; 30-50 µs each on a VM), which cost a third of the
    batch-8 decode. So they spin for a while (GOMP_SPINCOUNT iterations of about 10 ns,
    10,000: ~0.1 ms), then sleep: Python between a step's regions takes tens of µs, the
    gaps between steps longer. 1,000 spins was too short for those gaps on an Intel Xeon
    (the stack at 0.87x), while on a 2-core host with another busy process the longer
    spin costs the executor 0.6-0.8x (docs/overhead.md, the OpenMP wait policy).
    GOMP_SPINCOUNT=1000 in the environment spins briefly, 0 sleeps at once."""
    for name, value in EXECUTOR_OPENMP.items():
        os.environ.setdefault(name, value)


def _run_service(args) -> int:
    from shared.model_source import ModelNotFound, resolve_model
    try:
        # Checked before anything starts (a gateway's --api-server-count processes and an
        # executor's ranks would each print it otherwise); the scheduler reads the model's
        # tokenizer only when a request needs it.
        if args.command in ("gateway", "executor"):
            resolve_model(args.model)
        # the address it listens on: one line here, not a traceback from the bind
        flag = {"gateway": "--host", "executor": "--bind-host", "scheduler": "--metrics-host"
                }.get(args.command)
        host = getattr(args, flag[2:].replace("-", "_")) if flag else None
        if args.command == "scheduler" and not args.metrics_port:
            host = None                      # (no /metrics server)
        if host is not None and (problem := _host_problem(flag, host)):
            print(f"pagedserve {args.command}: {problem}", file=sys.stderr)
            return 2
        return _run_one_service(args)
    except ModelNotFound as exc:             # a setting the user can fix: no traceback
        print(f"pagedserve {args.command}: {exc}", file=sys.stderr)
        return 2


def _run_one_service(args) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "executor":
        executor_openmp_defaults()
        from services.executor.config import ExecutorConfigError
        from services.executor.service import run
        ranks = []
        if args.rank is None and args.tensor_parallel_size > 1:
            ranks = _start_ranks(args)
        try:
            return run(executor_config(args), ranks)
        except ExecutorConfigError as exc:   # a setting the user can fix: no traceback
            print(f"pagedserve executor: {exc}", file=sys.stderr)
            return 2
        finally:
            for proc in ranks:
                if proc.poll() is None:
                    proc.terminate()
            for proc in ranks:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    elif args.command == "scheduler":
        from services.scheduler.service import run
        if (problem := redis_problem(args.redis_url or "redis://127.0.0.1:6379/0")):
            print(f"pagedserve scheduler: {problem}", file=sys.stderr)
            return 2
        try:
            config = scheduler_config(args)
        except ValueError as exc:            # a setting the user can fix: no traceback
            print(f"pagedserve scheduler: {exc}", file=sys.stderr)
            return 2
        return run(config)
    elif args.command == "gateway":
        try:
            gateway_config(args).check()
        except ValueError as exc:            # a setting the user can fix: no traceback
            print(f"pagedserve gateway: {exc}", file=sys.stderr)
            return 2
        if (problem := redis_problem(args.redis_url or "redis://127.0.0.1:6379/0")):
            print(f"pagedserve gateway: {problem}", file=sys.stderr)
            return 2
        from services.gateway.servers import api_server_count, run_servers
        count = api_server_count(args.api_server_count)
        if count > 1:
            return run_servers(_serve_gateway, args, args.host, args.port, count)
        _serve_gateway(args)
    return 0


def _serve_gateway(args, sock: socket.socket | None = None) -> None:
    """One gateway process: on host:port, or on `sock` (one of --api-server-count's)."""
    import uvicorn

    from services.gateway.app import create_app
    if sock is not None:
        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from services.gateway.limits import uvicorn_options
    from shared.heap import settle_heap
    cfg = gateway_config(args)
    config = uvicorn.Config(create_app(cfg), host=args.host, port=args.port,
                            log_level=args.log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=5,   # open streams must not hold up a stop
                            **uvicorn_options(cfg))
    settle_heap()
    uvicorn.Server(config).run(sockets=None if sock is None else [sock])


def _start_ranks(args) -> list[subprocess.Popen]:
    """Tensor parallelism: start ranks 1..N-1 of this executor as child processes, each
    with this process's flags and its own --rank. They die with this process (Linux:
    PR_SET_PDEATHSIG), so the group lives and dies as one executor."""
    argv = [sys.executable, "-m", "services.launcher", "executor"] + _flags_for(args)["executor"]

    def die_with_parent():
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG

    env = dict(os.environ)
    if args.redis_url:
        env["REDIS_URL"] = args.redis_url
    return [subprocess.Popen(argv + ["--rank", str(r)], env=env, preexec_fn=die_with_parent)
            for r in range(1, args.tensor_parallel_size)]


def _healthcheck(args) -> int:
    try:
        if args.service == "gateway":
            host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
            with urllib.request.urlopen(f"http://{host}:{args.port}/ping", timeout=3) as r:
                return 0 if r.status == 200 else 1
        if args.service == "executor":
            from shared.control import ExecutorClient
            host = "127.0.0.1" if args.bind_host in ("0.0.0.0", "::") else args.bind_host
            return 0 if ExecutorClient(f"{host}:{args.grpc_port}").is_alive(3.0) else 1
        import redis
        from shared.redis_keys import RedisKeys
        r = redis.Redis.from_url(args.redis_url or "redis://127.0.0.1:6379/0", socket_timeout=3)
        beats = r.hgetall(RedisKeys(args.redis_prefix).schedulers)
        name = (args.scheduler_name or "").encode()
        fresh = [float(v) for k, v in beats.items() if not name or k == name]
        return 0 if fresh and time.time() - max(fresh) < 5 else 1
    except Exception as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1


# ---------------------------------------------------------------- the whole stack

def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


_RESERVED: dict[int, int] = {}     # port -> fd of its lock file, held until this process exits


def _reserve(port: int) -> bool:
    """Claim `port` for this process: free to bind on 127.0.0.1 now, and not claimed by any
    other process that uses this function (an flock on a file named after it)."""
    if port in _RESERVED:
        return False
    folder = os.path.join(tempfile.gettempdir(), "pagedserve-ports")
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, str(port)), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    except OSError:
        os.close(fd)
        return False
    _RESERVED[port] = fd
    return True


def free_ports(n: int = 1) -> int:
    """The first of n consecutive TCP ports for services this process starts (ZeroMQ takes p
    and p + 1; gRPC of rank r takes p + r).

    NOTE: a port the kernel hands out for bind(0) is an ephemeral one, and any outgoing
    connection on the machine may take it again before the service binds it. These ports
    lie below the ephemeral range, where only an explicit bind lands, and each is claimed
    (see `_reserve`) so that concurrent test runs and stacks do not pick the same one."""
    low = 10000
    high = min(_ephemeral_range()[0], 65536) - n
    rng = random.Random()
    for _ in range(10000):
        base = rng.randrange(low, high)
        claimed = []
        for p in range(base, base + n):
            if not _reserve(p):
                break
            claimed.append(p)
        if len(claimed) == n:
            return base
        for p in claimed:
            os.close(_RESERVED.pop(p))
    raise RuntimeError(f"no {n} consecutive free ports between {low} and {high + n}")


def free_port() -> int:
    """One TCP port for a service this process starts (see free_ports)."""
    return free_ports(1)


def _die_with_parent() -> None:
    """In a child, before exec: SIGTERM it when the process that started it dies (Linux
    PR_SET_PDEATHSIG), so that no service outlives a `serve` killed with SIGKILL."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


# Restart policy of `serve`, as compose's `restart: always`: a service that dies is started
# again after a delay that doubles from the first to the cap, and falls back to the first
# once the service has run RESTART_STABLE_S without dying.
RESTART_FIRST_S = 1.0
RESTART_CAP_S = 30.0
RESTART_STABLE_S = 60.0


class Stack:
    """Starts Redis (optional), executor, scheduler and gateway as separate processes, and
    (wait) keeps them running: a service that dies is restarted with backoff while the
    others go on; the stack reports degraded meanwhile (see docs/reliability.md)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.specs: dict[str, tuple[list[str], dict | None]] = {}   # name -> (argv, env)
        self.tmp = tempfile.mkdtemp(prefix="pagedserve-")

    def _spawn(self, name: str, argv: list[str], env=None) -> subprocess.Popen:
        proc = subprocess.Popen(argv, env=env, start_new_session=True,
                                preexec_fn=_die_with_parent)
        names = [n for n, _ in self.procs]
        if name in names:
            self.procs[names.index(name)] = (name, proc)
        else:
            self.procs.append((name, proc))
        self.specs[name] = (argv, env)
        return proc

    def _wait(self, name: str, proc: subprocess.Popen, ready, timeout: float,
              also: list[tuple[str, subprocess.Popen]] = ()) -> None:
        """Until `ready()`; a RuntimeError if `proc`, or one of `also` (services that are
        starting meanwhile), exits first, or after `timeout` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for who, p in [(name, proc), *also]:
                if p.poll() is not None:
                    raise RuntimeError(f"{who} exited with status {p.returncode} during start-up")
            try:
                if ready():
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{name} was not healthy after {timeout:.0f} s")

    def _choose_ports(self) -> None:
        """The executor's ports are private to this stack: free ones unless set by flag or
        environment. Ports that were set, and the HTTP port, must be free: else one line
        and nothing started (a second stack on one host must not reach the first one's)."""
        a = self.args
        hosts = [("--host", a.host), ("--bind-host", a.bind_host)]
        if a.metrics_port:
            hosts.append(("--metrics-host", a.metrics_host))
        if (problems := [p for flag, host in hosts if (p := _host_problem(flag, host))]):
            raise RuntimeError("; ".join(problems))
        tp = a.tensor_parallel_size
        wanted = {"--grpc-port": ("grpc_port", tp), "--zmq-port": ("zmq_port", 2 + tp),
                  "--dist-port": ("dist_port", 1)}
        for flag, (dest, n) in wanted.items():
            if not _given(a, flag):
                setattr(a, dest, free_ports(n))
            elif getattr(a, dest) + n - 1 > 65535:
                raise RuntimeError(f"{flag} {getattr(a, dest)} takes {n} ports from there "
                                   f"(up to {getattr(a, dest) + n - 1}): pick at most "
                                   f"{65536 - n}")
        taken = [f"{flag} {getattr(a, dest) + i}" for flag, (dest, n) in wanted.items()
                 if _given(a, flag) for i in range(n)
                 if not _port_free(a.bind_host, getattr(a, dest) + i)]
        if not _port_free(a.host, a.port):
            taken.insert(0, f"--port {a.port}")
        if taken:
            raise RuntimeError(f"port(s) in use: {', '.join(taken)} (another pagedserve? "
                               f"pick other ports)")

    def start(self) -> str:
        a = self.args
        self._choose_ports()
        if not a.redis_url:
            exe = shutil.which("redis-server")
            if exe is None:
                raise RuntimeError("redis-server not found on PATH: install it "
                                   "(apt-get install redis-server) or set REDIS_URL")
            port = free_port()
            proc = self._spawn("redis", [exe, "--port", str(port), "--bind", "127.0.0.1",
                                         "--save", "", "--appendonly", "no", "--dir", self.tmp,
                                         # full: writes are refused (503), nothing evicted
                                         "--maxmemory", PRIVATE_REDIS_MAXMEMORY,
                                         "--maxmemory-policy", "noeviction",
                                         "--loglevel", "warning",
                                         # its start-up banner would mix into our stdout
                                         "--logfile", os.path.join(self.tmp, "redis.log")])
            a.redis_url = f"redis://127.0.0.1:{port}/0"
            import redis
            self._wait("redis", proc, lambda: redis.Redis.from_url(a.redis_url).ping(), 30)
        # a Redis the user named must answer now: nothing is started otherwise
        if (problem := redis_problem(a.redis_url, must_answer=True)):
            raise RuntimeError(problem)
        # Secrets travel in the environment, never on a command line (/proc/*/cmdline is
        # readable by every local user).
        # The executor's control token: made here for this stack unless one is given.
        env = dict(os.environ, REDIS_URL=a.redis_url, PAGEDSERVE_API_KEYS=a.api_keys or "",
                   PAGEDSERVE_CONTROL_TOKEN=os.environ.get("PAGEDSERVE_CONTROL_TOKEN")
                   or secrets.token_hex(16))
        common = [sys.executable, "-m", "services.launcher"]
        grpc_addr = f"127.0.0.1:{a.grpc_port}"
        a.executor = grpc_addr
        flags = _flags_for(a)
        # With --tensor-parallel-size N the executor starts its other ranks itself.
        ex = self._spawn("executor", common + ["executor"] + flags["executor"], env)
        # The gateway needs neither the executor nor the scheduler to start (a request waits
        # in Redis; /health says 503 until a scheduler beats): it starts while the executor
        # loads the model, and its start-up failing is reported as soon as it happens.
        gw = self._spawn("gateway", common + ["gateway"] + flags["gateway"], env)
        from shared.control import ExecutorClient
        client = ExecutorClient(grpc_addr)
        # Rank 0 answers once every rank has joined the group and loaded its shard.
        self._wait("executor", ex, lambda: client.is_alive(1.0), a.startup_timeout,
                   also=[("gateway", gw)])
        # NOTE: the scheduler uses numpy for columns (scheduler/lead.py), never its BLAS;
        # OpenBLAS's own thread pool would only take CPU from the executor's threads.
        sc = self._spawn("scheduler", common + ["scheduler"] + flags["scheduler"],
                         {"OPENBLAS_NUM_THREADS": "1", **env})
        check = argparse.Namespace(**vars(a), service="scheduler")
        self._wait("scheduler", sc, lambda: _healthcheck(check) == 0, a.startup_timeout,
                   also=[("gateway", gw)])
        url = f"http://{a.host}:{a.port}"
        self._wait("gateway", gw, lambda: urllib.request.urlopen(url + "/health", timeout=2)
                   .status == 200, a.startup_timeout)
        return url

    def stop(self) -> None:
        """SIGTERM the services, then Redis (the services still talk to it while they shut
        down); SIGKILL whatever still runs 10 s after its SIGTERM. Safe to call again, and
        after a start() that was cut short."""
        services = [(n, p) for n, p in reversed(self.procs) if n != "redis"]
        _terminate(services)
        _terminate([(n, p) for n, p in self.procs if n == "redis"])
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "Stack":
        """`with Stack(args) as stack: url = stack.start() ...` stops every service when the
        block ends, also when this process gets SIGTERM or SIGINT (both raise
        KeyboardInterrupt in the block). NOTE: SIGTERM's default action ends a Python
        process without running any `finally`, and the services, each in its own session,
        would keep running."""
        self._handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._handlers[sig] = signal.signal(sig, _raise_interrupt)
        return self

    def __exit__(self, *exc) -> None:
        for sig in self._handlers:      # a second signal must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        try:
            self.stop()
        finally:
            for sig, handler in self._handlers.items():
                signal.signal(sig, handler)

    def wait(self, poll_s: float = 0.2) -> int:
        """Supervise until interrupted: restart a service that dies, with backoff."""
        delay = {name: RESTART_FIRST_S for name, _ in self.procs}
        started = {name: time.monotonic() for name, _ in self.procs}
        due: dict[str, float] = {}          # name -> when its restart is due
        while True:
            now = time.monotonic()
            for name, proc in list(self.procs):
                if name in due or proc.poll() is None:
                    continue
                if now - started[name] >= RESTART_STABLE_S:
                    delay[name] = RESTART_FIRST_S
                due[name] = now + delay[name]
                print(f"pagedserve: {name} exited with status {proc.returncode}; restarting "
                      f"it in {delay[name]:g} s (the stack is degraded meanwhile)",
                      file=sys.stderr, flush=True)
                delay[name] = min(RESTART_CAP_S, 2 * delay[name])
            for name, when in list(due.items()):
                if now >= when:
                    del due[name]
                    started[name] = now
                    argv, env = self.specs[name]
                    self._spawn(name, argv, env)
            time.sleep(poll_s)


def _terminate(procs: list[tuple[str, subprocess.Popen]], grace_s: float = 10.0) -> None:
    for _name, proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for _name, proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        # Each service leads its own session (start_new_session): end whatever it left
        # behind in its process group too.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _given(args: argparse.Namespace, flag: str) -> bool:
    """Was `flag` set on the command line or through its environment variable?"""
    env = next(e for table in _TABLES["serve"] for f, e, *_ in table if f == flag)
    argv = getattr(args, "argv", None) or []
    return env in os.environ or any(a == flag or a.startswith(flag + "=") for a in argv)


def _bind_error(host: str, port: int, reuse: bool = False) -> Exception | None:
    """What binding a TCP socket to host:port raises now (a name that does not resolve, an
    address of another machine, a port taken), or None. An IPv6 address gets a socket of
    its family."""
    try:
        family, kind, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        return exc
    with socket.socket(family, kind) as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            return exc
    return None


def _host_problem(flag: str, host: str) -> str | None:
    """Why no server can listen on `host` here, in one line, or None."""
    exc = _bind_error(host, 0)
    if exc is None:
        return None
    why = getattr(exc, "strerror", None) or exc
    if isinstance(exc, (socket.gaierror, UnicodeError)):
        return f"{flag} {host!r} is no address ({why})"
    return f"{flag} {host!r} cannot be listened on here ({why})"


def _port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now. With SO_REUSEADDR, as the gateway,
    gRPC and ZeroMQ bind: the connections a server closed linger on its port for a minute
    (FIN-WAIT-2, TIME-WAIT) after it exits and do not count; another listener does."""
    return _bind_error("127.0.0.1" if host in ("0.0.0.0", "::") else host, port,
                       reuse=True) is None


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _flags_for(args: argparse.Namespace) -> dict[str, list[str]]:
    """Re-emit the parsed flags that belong to each service, for its command line."""
    out = {}
    for name in ("gateway", "scheduler", "executor"):
        flags = []
        for table in _TABLES[name]:
            for flag, _env, _default, typ, _help in table:
                value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
                if typ == "flag":
                    if value:
                        flags.append(flag)
                elif typ == "names":
                    if value:
                        flags += [flag, *value]
                elif value is not None and flag not in ("--redis-url", "--api-keys"):
                    flags += [flag, str(value)]
        out[name] = flags
    return out


def _serve(args) -> int:
    from shared.model_source import ModelNotFound, resolve_model
    try:
        scheduler_config(args)              # its settings are checked before anything starts
        gateway_config(args).check()        # as are the gateway's
        resolve_model(args.model)           # and the model is there
    except (ValueError, ModelNotFound) as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 2
    stack = Stack(args)
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    # SIGINT too, explicitly: a shell starts a background job (`pagedserve serve &`) with
    # SIGINT ignored, and Python then installs no KeyboardInterrupt for it (uvicorn, too,
    # takes both signals whatever it inherited).
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        url = stack.start()
        print(f"pagedserve is up: {url}  (OpenAI API at {url}/v1; Ctrl-C stops everything)",
              flush=True)
        return stack.wait()
    except KeyboardInterrupt:
        print("\npagedserve: shutting down", file=sys.stderr)
        return 0
    except RuntimeError as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()


REDIS_PASSWORD_ENV = "PAGEDSERVE_REDIS_PASSWORD"


def with_password(url: str | None) -> str | None:
    """`url` with the password of PAGEDSERVE_REDIS_PASSWORD (environment only: a secret never
    goes on a command line) when it names none itself."""
    password = os.environ.get(REDIS_PASSWORD_ENV)
    if not url or not password:
        return url
    import urllib.parse
    parts = urllib.parse.urlsplit(url)
    if "@" in parts.netloc:
        return url
    netloc = f":{urllib.parse.quote(password, safe='')}@{parts.netloc}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command == "serve" and not args.redis_url:
        os.environ.pop(REDIS_PASSWORD_ENV, None)     # its private Redis has none
    elif hasattr(args, "redis_url"):
        args.redis_url = with_password(args.redis_url or "redis://127.0.0.1:6379/0")
    if args.command == "serve":
        return _serve(args)
    if args.command == "healthcheck":
        return _healthcheck(args)
    return _run_service(args)


if __name__ == "__main__":
    sys.exit(main())
