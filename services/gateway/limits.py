"""What one connection may hold of the gateway: its deadlines (per-key budgets: budgets.py).

Connection deadlines live in the HTTP protocol (uvicorn's, subclassed), the only place that
sees a connection before its headers are complete and that can drop a socket whose peer
stopped reading:

    connect ──▶ headers complete          within header_timeout_s, else the socket is cut
                (again after each response: a kept-alive connection's next request too)
    response body written ──▶ drained     a write that waits on a full socket buffer for
                                          send_timeout_s cuts the socket; the app sees
                                          http.disconnect and aborts the request
    body ──▶ read                         within body_timeout_s (the app, 408)
"""
from __future__ import annotations

import asyncio
import logging
import socket

from services.gateway.validation import ApiError

log = logging.getLogger("pagedserve.gateway")


# ------------------------------------------------------------ connection deadlines
WRITABLE = "pagedserve.writable"     # scope key: the connection's Writable
BODY_WRITER = "pagedserve.body_writer"   # scope key: the request's BodyWriter (httptools)


class Writable:
    """Whether a connection's write buffer has room (uvicorn's `send` would wait for it to
    drain when it has not). Put in every request's scope under WRITABLE, so that a writer
    that must not wait (the stream follower's reader) can tell before it sends."""

    __slots__ = ("paused",)

    def __init__(self) -> None:
        self.paused = False


class BodyWriter:
    """One request's streamed body written straight to its socket: the bytes uvicorn's
    httptools `send` writes for a chunked body piece, without the ASGI layers between
    (each middleware wraps `send` in a coroutine; an SSE token costs one send).

    In the scope under BODY_WRITER (httptools only). `write` refuses (returns False) where
    `send` would do anything else: before the response has started, after it completed,
    for a body that is not chunked, on a lost connection, or while the socket's buffer is
    full (send would wait); the caller then uses `send`."""

    __slots__ = ("cycle", "writable")

    def __init__(self, cycle, writable: Writable) -> None:
        self.cycle, self.writable = cycle, writable

    def write(self, body: bytes) -> bool:
        c = self.cycle
        if (self.writable.paused or c.disconnected or not c.response_started
                or c.response_complete or not c.chunked_encoding or not body):
            return False
        c.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True


class _Deadlines:
    """Mixed into uvicorn's protocol classes; the class attributes are set by protocol_class."""

    header_timeout_s = 10.0
    send_timeout_s = 30.0
    send_buffer_bytes = 0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if self.send_buffer_bytes and sock is not None:
            # NOTE: a fixed size turns off the kernel's autotuning, which grows a buffer to
            # MiBs for a peer that never reads; SSE needs far less.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
        self._header_timer = self._send_timer = None
        self.writable = Writable()
        self._arm_headers()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request on this connection, unless one was already parsed (pipelined):
        # self.cycle is the latest request whose headers are complete.
        if not self.transport.is_closing() and (self.cycle is None
                                                or self.cycle.response_complete):
            self._arm_headers()

    def pause_writing(self) -> None:
        super().pause_writing()
        self.writable.paused = True
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._cut,
                                                    "did not read its response")

    def resume_writing(self) -> None:
        super().resume_writing()
        self.writable.paused = False
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _headers_done(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _arm_headers(self) -> None:
        self._headers_done()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._cut,
                                                  "sent no complete request headers")

    def _disarm(self) -> None:
        self._headers_done()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _cut(self, why: str) -> None:
        # NOTE: abort, not close: close() waits to flush the write buffer, which a peer
        # that does not read never drains.
        log.info("dropping connection of %s: it %s in time", self.client, why)
        self._disarm()
        self.transport.abort()


def protocol_class(header_timeout_s: float, send_timeout_s: float,
                   send_buffer_bytes: int = 0) -> type:
    """uvicorn's HTTP protocol (httptools when installed, as uvicorn's "auto" picks, else h11)
    with the connection deadlines above."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base

        class Protocol(_Deadlines, base):
            def on_headers_complete(self) -> None:
                self._headers_done()
                scope = self.scope
                scope[WRITABLE] = self.writable
                super().on_headers_complete()
                # (the request's cycle exists now; its ASGI task has not started yet)
                if self.cycle is not None and self.cycle.scope is scope \
                        and scope.get("method") != "HEAD":
                    scope[BODY_WRITER] = BodyWriter(self.cycle, self.writable)
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

        class Protocol(_Deadlines, base):
            def handle_events(self) -> None:
                cycle = self.cycle
                super().handle_events()
                if self.cycle is not cycle:           # a request's headers were parsed
                    self._headers_done()
                    self.cycle.scope[WRITABLE] = self.writable

    Protocol.header_timeout_s = header_timeout_s
    Protocol.send_timeout_s = send_timeout_s
    Protocol.send_buffer_bytes = send_buffer_bytes
    return Protocol


def uvicorn_options(config) -> dict:
    """uvicorn.run / uvicorn.Config keyword arguments for a GatewayConfig."""
    return {"http": protocol_class(config.header_timeout_s, config.send_timeout_s,
                                   config.send_buffer_bytes),
            "timeout_keep_alive": config.timeout_keep_alive_s,
            "limit_concurrency": config.limit_concurrency or None}


async def within(seconds: float, coro, what: str):
    """Await coro; ApiError 408 if it takes longer than `seconds` (a body sent too slowly)."""
    try:
        return await asyncio.wait_for(coro, seconds)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the client took more than {seconds:g} s to send {what}: send it "
                            "faster", code="request_timeout") from None
