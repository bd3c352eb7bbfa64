"""A lean streaming client for the benchmarks: HTTP/1.1 over raw asyncio sockets.

A benchmark's clients share the machine with what they measure; httpx spends tens of
microseconds per SSE line, which on a small machine is CPU taken from the servers. This
client de-chunks the body, splits events and parses each `data:` JSON once (orjson when
installed), and records when each event arrived and how many characters of text it held,
all in the transport's data callback.
"""
from __future__ import annotations

import asyncio
import json
import socket
import struct
import time

try:
    from orjson import loads
except ImportError:                 # the standard parser: slower, same result
    loads = json.loads


class StreamError(RuntimeError):
    """The server answered with an error status."""


async def stream_completion(host: str, port: int, body: dict, path: str = "/v1/completions"
                            ) -> tuple[str, list[tuple[float, int]]]:
    """POST a streaming request; (X-Request-Id, [(time.time() at arrival, text characters
    of that event)] for every event that carried text). Raises StreamError on a non-200."""
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_connection(
        lambda: _SSEReader(loop.create_future()), host, port)
    try:
        transport.write(_request(host, path, body))
        return await proto.finished
    finally:
        transport.close()


def _request(host: str, path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (path.encode(), host.encode(), len(payload))
            + payload)


# Linux: the kernel's receive time of a socket's data, as a `struct timespec` cmsg
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_TIMESPEC = struct.Struct("@qq")


async def stream_completion_stamped(host: str, port: int, body: dict,
                                    path: str = "/v1/completions"
                                    ) -> tuple[str, list[tuple[float, int, float]]]:
    """`stream_completion`, and for each event also when its bytes reached this host's
    socket: [(time.time() at arrival, text characters, the kernel's receive time)]. The
    gap between the two is this process's own delay in reading (another socket's events
    read first, or the process not running), not the server's."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.setblocking(False)
    proto = _SSEReader(loop.create_future())
    try:
        await loop.sock_connect(sock, (host, port))
        await loop.sock_sendall(sock, _request(host, path, body))
        space = socket.CMSG_SPACE(_TIMESPEC.size)

        def readable() -> None:
            while not proto.finished.done():
                try:
                    data, anc, _flags, _addr = sock.recvmsg(1 << 16, space)
                except BlockingIOError:
                    return
                except OSError as exc:
                    proto.connection_lost(exc)
                    return
                if not data:
                    proto.eof_received()
                    return
                proto.stamp = next((_TIMESPEC.unpack(d[:_TIMESPEC.size]) for lvl, kind, d in anc
                                    if lvl == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS),
                                   None)
                proto.data_received(data)
        loop.add_reader(sock.fileno(), readable)
        try:
            return await proto.finished
        finally:
            loop.remove_reader(sock.fileno())
    finally:
        sock.close()


class _SSEReader(asyncio.Protocol):
    """Parses the response as its bytes arrive, in the transport's callback: no stream
    reader, no task woken per read (what a benchmark client spends per event is CPU taken
    from the servers it measures)."""

    def __init__(self, finished: asyncio.Future) -> None:
        self.finished = finished
        self.head: dict[str, str] | None = None      # the response's headers, once read
        self.chunked = False
        self.raw = self.sse = b""
        self.arrivals: list[tuple] = []
        # (seconds, nanoseconds) the kernel received the bytes being read, when known
        self.stamp: tuple[int, int] | None = None

    def data_received(self, data: bytes) -> None:
        if self.finished.done():
            return
        t = time.time()
        if self.head is None:
            self.raw += data
            end = self.raw.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data, self.raw = self.raw[:end].decode("latin-1"), self.raw[end + 4:], b""
            status = int(head.split(" ", 2)[1])
            self.head = {k.lower(): v for k, _, v in (line.partition(": ")
                                                      for line in head.split("\r\n")[1:] if line)}
            if status != 200:
                self.finished.set_exception(StreamError(f"HTTP {status}: {head[:200]}"))
                return
            self.chunked = self.head.get("transfer-encoding", "").lower() == "chunked"
        done = False
        if self.chunked:
            raw = self.raw + data
            while (eol := raw.find(b"\r\n")) >= 0:
                size = int(raw[:eol].split(b";")[0], 16)
                if len(raw) < eol + 4 + size:
                    break
                self.sse += raw[eol + 2:eol + 2 + size]
                raw = raw[eol + 4 + size:]
                if size == 0:
                    done = True
                    break
            self.raw = raw
        else:
            self.sse += data
        *events, self.sse = self.sse.split(b"\n\n")
        for ev in events:
            for line in ev.split(b"\n"):
                if line.startswith(b"data: {"):
                    n = sum(len(c.get("text") or (c.get("delta") or {}).get("content") or "")
                            for c in loads(line[6:])["choices"])
                    if n:
                        self.arrivals.append((t, n) if self.stamp is None else
                                             (t, n, self.stamp[0] + self.stamp[1] * 1e-9))
                elif line == b"data: [DONE]":
                    done = True
        if done:
            self._finish()

    def eof_received(self) -> None:
        self._finish()

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and not self.finished.done():
            self.finished.set_exception(exc)
        self._finish()

    def _finish(self) -> None:
        if not self.finished.done():
            if self.head is None:
                self.finished.set_exception(ConnectionError("the server closed the connection "
                                                            "before answering"))
            else:
                self.finished.set_result((self.head.get("x-request-id", ""), self.arrivals))
