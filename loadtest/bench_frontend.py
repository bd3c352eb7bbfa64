"""The front end's capacity: gateway process(es) + Redis, fed at a set token rate.

Three kinds of process, so that each one's CPU is counted apart:

  source    stands in for the scheduler's output path: every step it publishes one token
            for every running request through the scheduler's own RedisLink.round (same
            entries, same pipelining, heartbeats and acks), paced to --rate tokens/s
  gateway   `pagedserve gateway [--api-server-count N]`, the real process(es)
  clients   raw-socket asyncio HTTP/1.1 clients streaming /v1/completions (SSE), one
            connection per stream, --client-procs processes

Every token the source publishes is one character of text, so the clients know which
token each SSE event carries (coalesced events carry several) and the added latency of
every token is exact: its arrival at the client minus the time the source handed it to
Redis (one host, one clock). With --socket-times, `added_ms_p99_at_socket` takes the
kernel's receive time of the bytes at the client's socket instead (SO_TIMESTAMPNS): what
the clients' own reading adds (one process reads hundreds of sockets in turn) is left out.

    python loadtest/bench_frontend.py [--streams 256] [--rate 25600] [--tokens 200]
        [--processes 1,2] [--baseline main] [--repeats 3] [--pin] [--json]

--baseline REV runs the one-process case once more with the gateway of git revision REV
(checked out in a temporary worktree; same source, same clients), for a before/after in
one run. --repeats R runs every case R times in turns (baseline, current, baseline, ...)
and reports each case's medians (`medians` in the JSON; `runs` keeps every run): on a VM
whose speed drifts, single runs of two trees are not comparable. Figures and commands:
docs/overhead.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.sse_client import (  # noqa: E402
    StreamError,
    stream_completion,
    stream_completion_stamped,
)
from loadtest.docgen import cpu  # noqa: E402

PREFIX = "benchfe"
PROFILED = ("import cProfile, os, runpy, signal, sys; p = cProfile.Profile(); "
            "signal.signal(signal.SIGTERM, lambda *a: (p.disable(), p.dump_stats({out!r}), "
            "os._exit(0))); sys.argv[0] = 'launcher'; p.enable(); "
            "runpy.run_module('services.launcher', run_name='__main__')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (utime is [11]); None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads, live or exited; read from its
    POSIX CPU clock, to the nanosecond) and of its reaped children (s); 0 once it is gone.
    /proc's tick count alone is 10 ms coarse: a small run's delta would round to 0."""
    fields = _stat(pid)
    if fields is None:
        return 0.0
    reaped = sum(int(x) for x in fields[13:15]) / os.sysconf("SC_CLK_TCK")
    try:
        return time.clock_gettime(((~pid) << 3) | 2) + reaped    # CPUCLOCK_SCHED of pid
    except OSError:
        return sum(int(x) for x in fields[11:13]) / os.sysconf("SC_CLK_TCK") + reaped


def user_system_ticks(pid: int) -> tuple[int, int]:
    """(user, system) clock ticks of a live process, all its threads; (0, 0) once gone.
    Coarse (10 ms), but over a run of seconds it tells how much of a process's CPU the
    kernel spends for it (its socket writes and loopback TCP)."""
    fields = _stat(pid)
    return (0, 0) if fields is None else (int(fields[11]), int(fields[12]))


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


# ---------------------------------------------------------------- the token source

def run_source(args) -> None:
    """Publish one token per running request per step, through the scheduler's RedisLink
    (of the tree measured: the baseline's own output path for the baseline)."""
    sys.path.insert(0, args.tree)
    import redis

    from services.scheduler.redis_link import Heartbeat, RedisLink
    from shared.messages import RequestOutput, SeqDelta
    try:        # a tree whose link takes outputs encoded (as its scheduler publishes them)
        from services.scheduler.outputs import outgoing
    except ImportError:
        def outgoing(out):
            return out
    from shared.redis_keys import RedisKeys
    try:        # a tree whose scheduler packs its commands with shared.redis_packing
        from shared.redis_packing import packer
        client_options = {"command_packer": packer()}
    except ImportError:
        client_options = {}

    link = RedisLink(redis.Redis.from_url(args.redis_url, **client_options), RedisKeys(PREFIX),
                     "bench-source")
    link.ensure_group()
    ids = [int(x) for x in args.token_ids.split(",")]
    step_s = args.step_ms / 1000
    running: dict[str, list] = {}       # request id -> [entry id, tokens sent, max_tokens]
    published: dict[str, list[float]] = {}   # request id -> time each token was handed over
    ended, acks, outputs, rids = 0, [], [], []
    stop = False

    def on_term(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    cpu0 = own_cpu_s()                  # the publishing loop only, not the imports
    next_step = time.monotonic()
    while not stop and ended < args.expect:
        now = time.time()
        inbound = link.round(outputs, acks, Heartbeat(now=link.now()), read=True, want=4096)
        for rid in rids:
            published[rid].append(now)
        outputs, rids, acks = [], [], []
        for entry_id, req in inbound.requests:
            running[req.request_id] = [entry_id, 0, req.sampling.max_tokens]
            published[req.request_id] = []
        for rid, state in list(running.items()):
            entry_id, sent, budget = state
            last = sent + 1 >= budget
            delta = SeqDelta(0, [ids[sent % len(ids)]], finish_reason="length" if last else None)
            outputs.append(outgoing(RequestOutput(rid, [delta], finished=last)))
            rids.append(rid)
            state[1] = sent + 1
            if last:
                del running[rid]
                acks.append(entry_id)
                ended += 1
        next_step += step_s
        delay = next_step - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            next_step = time.monotonic()      # behind: no burst to catch up
    if outputs or acks:
        now = time.time()
        link.round(outputs, acks, None, read=False)
        for rid in rids:
            published[rid].append(now)
    Path(args.out).write_text(json.dumps({"published": published, "cpu_s": own_cpu_s() - cpu0}))


# ---------------------------------------------------------------- the clients

async def _stream(port: int, body: dict, out: dict, stamped: bool) -> None:
    read = stream_completion_stamped if stamped else stream_completion
    try:
        rid, arrivals = await read("127.0.0.1", port, body)
    except StreamError as exc:
        out.setdefault("_errors", []).append(str(exc))
        return
    out[rid] = arrivals


def run_clients(args) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    body = {"prompt": "hello", "max_tokens": args.tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    out: dict = {}
    cpu0 = own_cpu_s()

    async def go():
        # open the streams in waves: a burst of thousands of connects overflows the backlog
        tasks = []
        for i in range(args.streams):
            tasks.append(asyncio.create_task(_stream(args.port, body, out,
                                                     args.socket_times)))
            if i % 64 == 63:
                await asyncio.sleep(0.01)
        await asyncio.gather(*tasks, return_exceptions=False)

    asyncio.run(go())
    Path(args.out).write_text(json.dumps({"streams": out, "cpu_s": own_cpu_s() - cpu0}))


# ---------------------------------------------------------------- one measured run

def start_redis(tmp: str, cores: set[int] | None = None) -> tuple[subprocess.Popen, str]:
    import redis
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", tmp,
                             "--loglevel", "warning"], stdout=subprocess.DEVNULL,
                            preexec_fn=pinned(cores))
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def single_char_tokens() -> list[int]:
    """Ids of tokens whose text is one lowercase letter (each token: one character)."""
    from services.gateway.detokenizer import TokenVocab
    from shared.model_source import load_tokenizer, resolve_model
    vocab = TokenVocab(load_tokenizer(resolve_model("SmolLM2-135M-Instruct")))
    found = {}
    for i, b in enumerate(vocab.token_bytes or []):
        if len(b) == 1 and b.isalpha() and b.islower() and b not in found:
            found[b] = i
    return sorted(found.values())


def pinned(cores: set[int] | None):
    """A preexec_fn that runs the child on `cores` only (None: anywhere)."""
    if cores is None:
        return None
    return lambda: os.sched_setaffinity(0, cores)


def split_cores(processes: int) -> tuple[set[int], set[int]]:
    """--pin: the gateway processes' cores, and the others' (source, Redis, clients)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) <= processes:
        raise SystemExit(f"--pin: {processes} gateway process(es) need a core each and one "
                         f"more for the rest; this machine lets us use {len(cores)}")
    return set(cores[:processes]), set(cores[processes:])


def measure(args, processes: int, tree: Path, token_ids: list[int], label: str) -> dict:
    gw_cores, rest = split_cores(processes) if args.pin else (None, None)
    tmp = tempfile.mkdtemp(prefix="bench-frontend-")
    redis_proc, url = start_redis(tmp, rest)
    port = free_port()
    me = [sys.executable, str(Path(__file__).resolve())]
    env = dict(os.environ, PYTHONPATH=str(tree))
    gw_cmd = [sys.executable, "-m", "services.launcher", "gateway", "--port", str(port),
              "--redis-url", url, "--redis-prefix", PREFIX, "--log-level", "warning",
              "--max-queue", "1000000"]
    if processes > 1 or label != "baseline":
        gw_cmd += ["--api-server-count", str(processes)]
    if args.profile:       # uvicorn ends on a re-raised SIGTERM: dump the stats then
        gw_cmd[1:3] = ["-c", PROFILED.format(out=f"{args.profile}-{label}-{processes}.prof")]
    gw = subprocess.Popen(gw_cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                          preexec_fn=pinned(gw_cores))
    procs = [gw]
    try:
        import httpx
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ping", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if gw.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{label}: the gateway did not start")
            time.sleep(0.2)
        time.sleep(2.0 if processes > 1 else 0.2)   # every worker up
        step_ms = 1000 * args.streams / args.rate
        src_out, cli_outs = Path(tmp, "source.json"), []
        src = subprocess.Popen(me + ["--role", "source", "--redis-url", url,
                                     "--step-ms", str(step_ms), "--expect", str(args.streams),
                                     "--token-ids", ",".join(map(str, token_ids)),
                                     "--out", str(src_out), "--tree", str(tree)],
                               preexec_fn=pinned(rest))
        procs.append(src)
        gw_pids = [gw.pid] + children(gw.pid)
        watched = {"gateway": gw_pids, "redis": [redis_proc.pid]}
        cpu0 = {k: sum(map(cpu_seconds, v)) for k, v in watched.items()}
        ticks0 = [user_system_ticks(p) for p in gw_pids]
        t0 = time.time()
        clients = []
        per = [args.streams // args.client_procs + (i < args.streams % args.client_procs)
               for i in range(args.client_procs)]
        for i, n in enumerate(per):
            cli_outs.append(Path(tmp, f"clients{i}.json"))
            clients.append(subprocess.Popen(me + ["--role", "clients", "--port", str(port),
                                                  "--streams", str(n), "--tokens",
                                                  str(args.tokens), "--out", str(cli_outs[-1]),
                                                  *(["--socket-times"] if args.socket_times
                                                    else [])],
                                            preexec_fn=pinned(rest)))
        procs += clients
        for c in clients:
            c.wait(timeout=args.timeout)
        parts = [json.loads(f.read_text()) for f in cli_outs]
        refused = [e for part in parts for e in part["streams"].get("_errors", [])]
        if refused:     # the source waits for every stream to end: those never reach it
            raise SystemExit(f"bench_frontend: the gateway refused {len(refused)} of "
                             f"{args.streams} streams ({refused[0].splitlines()[0][:200]}); "
                             f"--tokens {args.tokens} may be over the model's length")
        src.wait(timeout=30)
        cpu = {k: sum(map(cpu_seconds, v)) - cpu0[k] for k, v in watched.items()}
        ticks = [tuple(b - a for a, b in zip(t0_, user_system_ticks(p)))
                 for p, t0_ in zip(gw_pids, ticks0)]
        gw_user, gw_sys = sum(t[0] for t in ticks), sum(t[1] for t in ticks)
        source = json.loads(src_out.read_text())
        published, cpu["source"] = source["published"], source["cpu_s"]
        got: dict = {}
        cpu["clients"] = 0.0
        for part in parts:
            got.update(part["streams"])
            cpu["clients"] += part["cpu_s"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        redis_proc.terminate()
        redis_proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    errors = got.pop("_errors", [])
    lat, at_socket, tokens, first_pub, last_arrival = [], [], 0, float("inf"), 0.0
    for rid, arrivals in got.items():
        pub = published.get(rid, [])
        k = 0
        for t, n, *stamp in arrivals:
            for _ in range(n):
                if k < len(pub) and k >= args.skip_first:
                    lat.append((t - pub[k]) * 1000)
                    if stamp:
                        at_socket.append((stamp[0] - pub[k]) * 1000)
                k += 1
        tokens += k
        if pub:
            first_pub = min(first_pub, pub[0])
        if arrivals:
            last_arrival = max(last_arrival, arrivals[-1][0])
    wall = max(1e-9, last_arrival - first_pub)
    events = sum(len(a) for a in got.values())
    return {
        "label": label, "processes": processes, "streams": args.streams,
        "offered_tokens_per_s": args.rate, "tokens": tokens, "errors": len(errors),
        "tokens_per_s": round(tokens / wall, 1), "wall_s": round(wall, 2),
        "tokens_per_event": round(tokens / max(1, events), 2),
        "cpu_us_per_token": {k: round(1e6 * v / max(1, tokens), 2) for k, v in cpu.items()},
        # the share of the gateway's CPU spent in the kernel (/proc's ticks)
        "gateway_kernel_share": round(gw_sys / max(1, gw_user + gw_sys), 2),
        "added_ms_p50": round(pct(lat, 50), 2), "added_ms_p99": round(pct(lat, 99), 2),
        # the same up to the client's socket (the kernel's receive time): without the
        # clients' own delay in reading, a process that reads hundreds of sockets in turn
        "added_ms_p50_at_socket": round(pct(at_socket, 50), 2) if at_socket else None,
        "added_ms_p99_at_socket": round(pct(at_socket, 99), 2) if at_socket else None,
        "since_start_s": round(time.time() - t0, 1),
    }


def baseline_tree(rev: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="bench-frontend-base-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path), rev],
                   check=True)
    return path


def medians(rows: list[dict]) -> list[dict]:
    """One row per (label, processes), in first-run order: each figure the median of that
    case's runs (with one run each, the runs themselves)."""
    cases: dict[tuple, list[dict]] = {}
    for r in rows:
        cases.setdefault((r["label"], r["processes"]), []).append(r)
    out = []
    for group in cases.values():
        row = dict(group[0])
        if len(group) > 1:
            for key, value in row.items():
                if isinstance(value, dict):
                    row[key] = {k: statistics.median(g[key][k] for g in group) for k in value}
                elif isinstance(value, (int, float)) and key != "processes":
                    row[key] = statistics.median(g[key] for g in group)
            row["repeats"] = len(group)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["bench", "source", "clients"], default="bench",
                    help=argparse.SUPPRESS)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--rate", type=float, default=25_600, help="offered tokens/s (all streams)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    ap.add_argument("--processes", default="1", help="comma-separated api-server counts")
    ap.add_argument("--client-procs", type=int, default=1)
    ap.add_argument("--socket-times", action="store_true",
                    help="also report the added latency up to the clients' sockets (the "
                         "kernel's receive times; the clients read with recvmsg in Python, "
                         "about 2 us a token more of their CPU)")
    ap.add_argument("--baseline", default=None, help="git revision to run as the baseline")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every case this many times, in turns (the baseline alternating "
                         "with the current tree), and report the medians")
    ap.add_argument("--skip-first", type=int, default=2,
                    help="tokens per stream left out of the latency (admission, not streaming)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pin", action="store_true",
                    help="run the gateway process(es) on cores of their own (one each) and "
                         "the source, Redis and the clients on the others")
    ap.add_argument("--profile", default=None,
                    help="path prefix: write cProfile stats of the gateway (one process)")
    for hidden in ("--redis-url", "--token-ids", "--out", "--tree"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--step-ms", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--expect", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "source":
        return run_source(args)
    if args.role == "clients":
        return run_clients(args)
    token_ids = single_char_tokens()
    rows = []
    tree = baseline_tree(args.baseline) if args.baseline else None
    try:
        for _ in range(max(1, args.repeats)):
            if tree is not None:
                rows.append(measure(args, 1, tree, token_ids, "baseline"))
            for n in [int(x) for x in args.processes.split(",")]:
                rows.append(measure(args, n, REPO, token_ids, "current"))
    finally:
        if tree is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)])
    runs, rows = rows, medians(rows)
    current = [r for r in rows if r["label"] == "current"]
    one = next((r for r in current if r["processes"] == 1), current[0])
    out = {
        "tokens_per_s_one_process": one["tokens_per_s"],
        "tokens_per_s_by_processes": {str(r["processes"]): r["tokens_per_s"] for r in current},
        "cpu_us_per_token": one["cpu_us_per_token"],
        "added_ms_p50": one["added_ms_p50"], "added_ms_p99": one["added_ms_p99"],
        "added_ms_p99_at_socket": one["added_ms_p99_at_socket"],
        "one_core_capacity_tokens_per_s": round(1e6 / max(1e-9, one["cpu_us_per_token"]
                                                          ["gateway"])),
        "runs": runs, "cpu_model": cpu(), "cores": os.cpu_count(), "pinned": args.pin,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    base = next((r for r in rows if r["label"] == "baseline"), None)
    if base:
        out["baseline"] = {k: base[k] for k in ("tokens_per_s", "cpu_us_per_token",
                                                "added_ms_p50", "added_ms_p99")}
        out["speedup_gateway_cpu"] = round(base["cpu_us_per_token"]["gateway"]
                                           / max(1e-9, one["cpu_us_per_token"]["gateway"]), 2)
    if args.repeats > 1:
        out["medians"] = rows
    if args.json:
        print(json.dumps(out))
        return
    print(f"{'run':10}{'procs':>6}{'tok/s':>10}{'tok/event':>10}{'gw µs/tok':>10}"
          f"{'redis':>8}{'source':>8}{'p50 ms':>9}{'p99 ms':>9}")
    for r in rows:
        c = r["cpu_us_per_token"]
        print(f"{r['label']:10}{r['processes']:>6}{r['tokens_per_s']:>10.0f}"
              f"{r['tokens_per_event']:>10.2f}{c['gateway']:>10.1f}{c['redis']:>8.1f}"
              f"{c['source']:>8.1f}{r['added_ms_p50']:>9.2f}{r['added_ms_p99']:>9.2f}")
    print(f"offered {args.rate:.0f} tok/s over {args.streams} streams; {out['cpu_model']}, "
          f"load avg {out['loadavg_1m']}")


if __name__ == "__main__":
    main()
