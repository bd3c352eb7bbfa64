"""`GET /dashboard` (one self-contained HTML page) and `GET /dashboard/stream` (its SSE feed).

    page    services/gateway/static/dashboard.html: no external script, style or font
    stream  every 0.25 s: the latest snapshot of each live scheduler (shared/dashboard.py),
            sent when it changed, as `event: snapshot` whose data is the scheduler's JSON as is;
            `event: replicas` with the live scheduler names when they change

While a stream is open the gateway keeps `{prefix}:dash:watchers` alive; schedulers build
snapshots only while that key exists, so with no page open the dashboard costs nothing.

Auth: when API keys are set, both routes take the key as `Authorization: Bearer <key>`,
as `?key=<key>`, or from the `pagedserve_key` cookie. A page loaded with `?key=` sets that
cookie (HttpOnly, SameSite=Strict, path /dashboard), because the browser's EventSource
cannot send an Authorization header.
"""
from __future__ import annotations

import asyncio
import hmac
import importlib.resources
import json
import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from services.gateway.queue import QueueUnavailable, RequestQueue
from services.gateway.validation import ApiError
from shared.dashboard import WATCHERS_TTL_S

COOKIE = "pagedserve_key"
POLL_S = 0.25            # how often a stream looks for new snapshots (PUBLISH_HZ is 4)
KEEPALIVE_S = 10.0       # an SSE comment after this much silence keeps proxies from closing it
LIVE_BEAT_S = 5.0        # a scheduler whose heartbeat is older is left out of the picker


def _page() -> bytes:
    return (importlib.resources.files("services.gateway") / "static" / "dashboard.html"
            ).read_bytes()


class Dashboard:
    def __init__(self, queue: RequestQueue, api_keys: list[str]) -> None:
        self.queue = queue
        self.keys = [k.encode() for k in api_keys]
        self.html = _page()

    def _given_key(self, request: Request) -> bytes:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip().encode()
        return (request.query_params.get("key") or request.cookies.get(COOKIE) or "").encode()

    def _check(self, request: Request) -> bytes:
        """The key given (b"" when none is needed); ApiError 401 when a wrong one or none is."""
        if not self.keys:
            return b""
        given = self._given_key(request)
        ok = False
        for key in self.keys:           # no early exit: timing says nothing about which key
            ok |= hmac.compare_digest(given, key)
        if not ok:
            raise ApiError(401, "missing or wrong API key: open /dashboard?key=<key> (or send "
                                "'Authorization: Bearer <key>')", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return given

    async def page(self, request: Request) -> Response:
        given = self._check(request)
        resp = Response(self.html, media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-store"})
        if given and request.query_params.get("key"):
            resp.set_cookie(COOKIE, given.decode(), path="/dashboard", httponly=True,
                            samesite="strict")
        return resp

    async def stream(self, request: Request) -> StreamingResponse:
        self._check(request)
        return StreamingResponse(self._events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store",
                                          "X-Accel-Buffering": "no"})

    async def _events(self) -> AsyncIterator[bytes]:
        r, keys = self.queue.redis, self.queue.keys
        sent: dict[str, bytes] = {}
        names: list[str] = []
        next_watch = last_send = 0.0
        yield b"retry: 1000\n\n"
        while True:
            now = time.monotonic()
            out: list[bytes] = []
            try:
                if now >= next_watch:
                    next_watch = now + 1.0
                    await self.queue.call(r.set(keys.dashboard_watchers, b"1",
                                                ex=WATCHERS_TTL_S))
                    # heartbeats and `now` both in the Redis server's clock
                    beats, _degraded, redis_now = await self.queue.scheduler_status()
                    live = sorted(n for n, t in beats.items() if redis_now - t < LIVE_BEAT_S)
                    if live != names:
                        names = live
                        out.append(b"event: replicas\ndata: " + json.dumps(names).encode()
                                   + b"\n\n")
                if names:
                    values = await self.queue.call(r.mget([keys.dashboard(n) for n in names]))
                    for name, data in zip(names, values):
                        if data is not None and sent.get(name) != data:
                            sent[name] = data
                            out.append(b"event: snapshot\ndata: " + data + b"\n\n")
            except QueueUnavailable as exc:
                out.append(b"event: failure\ndata: " + json.dumps(str(exc)).encode() + b"\n\n")
            if not out and now - last_send > KEEPALIVE_S:
                out.append(b": keep-alive\n\n")
            if out:
                last_send = now
                yield b"".join(out)
            await asyncio.sleep(POLL_S)

    def routes(self) -> list[Route]:
        return [Route("/dashboard", self.page, methods=["GET"]),
                Route("/dashboard/stream", self.stream, methods=["GET"])]
