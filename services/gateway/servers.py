"""N gateway processes on one port: the API servers of `--api-server-count`.

One Python process streams a bounded number of tokens a second (docs/overhead.md); past
that the front end needs more cores, so the gateway runs as N processes:

    pagedserve gateway --api-server-count N
        └─ this supervisor (no event loop, no Redis)
             ├─ server 0: uvicorn + the gateway app, own socket bound with SO_REUSEPORT
             ├─ server 1: ...                                   (same host:port)
             └─ server N-1

The kernel spreads incoming connections over the N listening sockets. A connection stays
with the process that accepted it, and each process follows only its own clients' output
streams (its own StreamFollower: one XREAD for all of them), so nothing is shared between
servers but Redis. The supervisor ends the group when any server exits (the stack then
restarts the whole gateway), and passes SIGTERM / SIGINT on to the servers.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
from typing import Callable


MAX_AUTO_SERVERS = 8
CORES_PER_AUTO_SERVER = 4     # the rest go to the executor, scheduler and Redis


def api_server_count(requested: int) -> int:
    """The number of processes to run: `requested`, or (0) one per 4 cores, 1 to 8."""
    if requested > 0:
        return requested
    return max(1, min(MAX_AUTO_SERVERS, (os.cpu_count() or 1) // CORES_PER_AUTO_SERVER))


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port that other processes may bind too."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(addr)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _die_with_parent() -> None:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def _server_main(serve: Callable, args, host: str, port: int) -> None:
    _die_with_parent()
    serve(args, reuse_port_socket(host, port))


def run_servers(serve: Callable[..., int | None], args, host: str, port: int,
                count: int) -> int:
    """Run `serve(args, sock)` in `count` processes (spawned: a fresh interpreter each),
    each on its own SO_REUSEPORT socket. Returns when one exits: its exit status."""
    ctx = multiprocessing.get_context("spawn")
    servers = [ctx.Process(target=_server_main, args=(serve, args, host, port),
                           name=f"gateway-{i}") for i in range(count)]
    for proc in servers:
        proc.start()

    def stop(*_):
        for proc in servers:
            if proc.is_alive():
                proc.terminate()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        multiprocessing.connection.wait([p.sentinel for p in servers])
        # (None: a signal to this supervisor ended the wait)
        status = next((p.exitcode for p in servers if p.exitcode is not None), None)
    finally:
        stop()
        for proc in servers:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if status is None or status < 0 else status
