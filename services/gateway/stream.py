"""Answering one generation request from its Redis output stream: SSE events or one JSON body.

Event ids. Every SSE event made from a Redis entry carries `id: <entry id>`; one entry
makes at most one event (all choices that changed, together), so `Last-Event-ID` names
exactly what a client has seen:

    id: <header entry>   chat only: {"delta": {"role": "assistant"}} for every choice
    id: <entry 1>        choices that changed in RequestOutput 1
    ...
    id: <final entry>    the last deltas with finish_reason
                         usage chunk (stream_options.include_usage), then [DONE]: no id

Resumption: GET /v1/streams/{request_id} with `Last-Event-ID: <id>` (or the query
parameter `last_event_id`) replays the stream silently up to that id, rebuilding the
detokenizer and stop-string state, then streams what follows exactly as the first
connection would have (same ids, same text). Without an id it streams from the start.
Any replica can serve it: the stream's header entry holds the response spec.

Outputs arrive through the process-wide `StreamFollower` (one XREAD for all streams).
Disconnects are watched all along: the client's `http.disconnect` ends the wait for the
next output at once, and the request is aborted at once, unless another connection (a
resumed one) still follows it. With `abort_grace_s` > 0 the gateway first waits that long
for the client to come back with Last-Event-ID.
"""
from __future__ import annotations

import asyncio
import logging

from services.gateway.follower import Subscription, stream_id
from services.gateway.output import OutputProcessor
from services.gateway.protocol import ResponseSpec
from services.gateway.queue import QueueUnavailable
from services.gateway.responses import Shapes, dumps
from services.gateway.validation import ApiError

log = logging.getLogger("pagedserve.gateway")

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
DONE = b"data: [DONE]\n\n"


def event(entry_id: str | None, body: dict) -> bytes:
    head = f"id: {entry_id}\n".encode() if entry_id else b""
    return head + b"data: " + dumps(body) + b"\n\n"


class GenerationStream:
    """The ASGI response of a generation (or of a resumed stream)."""

    def __init__(self, gw, spec: ResponseSpec, header_id: str, *, resumed: bool = False,
                 last_event_id: str | None = None, sub: Subscription | None = None) -> None:
        self.gw, self.spec, self.header_id = gw, spec, header_id
        self.resumed, self.last_event_id = resumed, last_event_id
        self.proc = OutputProcessor(spec, gw.vocab)
        self.shapes = Shapes(spec, gw.vocab)
        self.cursor = header_id    # where following the stream starts
        self.gone = False          # the client disconnected
        self.sub = sub             # already following (fresh requests) or None (resumed)

    async def __call__(self, scope, receive, send) -> None:
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.gone = True
            if self.sub is not None:
                self.sub.interrupt()

        watcher = asyncio.ensure_future(watch())
        self.gw.metrics.streams.inc()
        try:
            if self.sub is None:
                await self.gw.queue.attach(self.spec.request_id)
                await self._replay()
                self.sub = await self.gw.follower.subscribe(self.spec.request_id, self.cursor)
            if self.spec.stream or self.resumed:
                await self._sse(send)
            else:
                await self._unary(send)
        finally:
            watcher.cancel()
            if self.sub is not None:
                self.gw.follower.unsubscribe(self.sub)
            self.gw.metrics.streams.dec()

    # ------------------------------------------------------------ reading
    async def _next(self, wait_s: float):
        """New outputs, [] after wait_s, None once the client has gone."""
        if self.gone:
            return None
        return await self.sub.get(wait_s)

    async def _client_gone(self) -> None:
        if self.proc.scheduler_finished:
            return
        queue, rid = self.gw.queue, self.spec.request_id
        try:
            if await queue.detach(rid) > 0:
                return
            if self.gw.config.abort_grace_s > 0:
                await asyncio.sleep(self.gw.config.abort_grace_s)
                if await queue.readers(rid) > 0:
                    return
        except QueueUnavailable:
            pass
        await self._abort_if_running("client_disconnected")

    async def _stop_finished_choices(self) -> None:
        """n > 1: a choice that ended at a stop string stops its sequence in the scheduler,
        so that it no longer takes a batch slot while the other choices go on. (When every
        choice is done, one abort of the whole request does that instead.)"""
        stopped, self.proc.stopped_here = self.proc.stopped_here, []
        if not self.proc.done and not self.proc.scheduler_finished:
            for index in stopped:
                self.gw.metrics.aborts.labels("stop_string_choice").inc()
                await self.gw.queue.abort(self.spec.request_id, "stop_string", index)

    async def _abort_if_running(self, reason: str) -> None:
        if not self.proc.scheduler_finished:
            self.proc.scheduler_finished = True
            self.gw.metrics.aborts.labels(reason).inc()
            await self.gw.queue.abort(self.spec.request_id, reason)

    def _refusal(self) -> ApiError:
        message, status = self.proc.error
        return ApiError(status, message, code="request_refused" if status < 500 else None)

    def _count_usage(self) -> None:
        if not self.resumed and self.proc.done and self.proc.error is None:
            self.gw.metrics.tokens.inc(self.proc.usage()["completion_tokens"])

    # ------------------------------------------------------------ one JSON body
    async def _unary(self, send) -> None:
        deltas: list[list] = [[] for _ in range(self.spec.n)]
        while not self.proc.done:
            outputs = await self._next(self.gw.config.read_block_ms / 1000)
            if outputs is None:
                await self._client_gone()
                return
            for _entry, out in outputs:
                for d in self.proc.process(out):
                    deltas[d.index].append(d)
                if self.proc.done:
                    break
            await self._stop_finished_choices()
        await self._abort_if_running("stop_string")
        if self.proc.error is not None:
            raise self._refusal()
        self._count_usage()
        body = dumps(self.shapes.whole(self.proc, deltas))
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"x-request-id", self.spec.request_id.encode())]})
        await send({"type": "http.response.body", "body": body})

    # ------------------------------------------------------------ server-sent events
    async def _replay(self) -> None:
        """Resuming: rebuild the state the first connection had at Last-Event-ID."""
        upto = self.last_event_id
        if upto is None or stream_id(upto) <= stream_id(self.header_id):
            return
        cursor = self.header_id
        while not self.proc.done:
            new, outputs = await self.gw.queue.range(self.spec.request_id, cursor, upto)
            if new == cursor:
                break
            cursor = new
            for _entry, out in outputs:
                self.proc.process(out)
                if self.proc.done:
                    break
        self.proc.stopped_here = []     # the first connection stopped those choices
        self.cursor = upto

    async def _sse(self, send) -> None:
        cfg, loop = self.gw.config, asyncio.get_running_loop()
        frames: list[bytes] = []
        if self.spec.kind == "chat" and (self.last_event_id is None or
                                         stream_id(self.last_event_id) < stream_id(self.header_id)):
            frames.append(event(self.header_id, self.shapes.role_chunk()))
        # A fresh stream holds its headers briefly: a refusal then becomes an HTTP status.
        started = False
        hold_until = loop.time() + (0.0 if self.resumed else cfg.stream_start_wait_s)
        quiet_since = loop.time()

        async def flush(more: bool = True) -> None:
            nonlocal started, frames, quiet_since
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200, "headers": [
                    *SSE_HEADERS, (b"x-request-id", self.spec.request_id.encode())]})
            await send({"type": "http.response.body", "body": b"".join(frames),
                        "more_body": more})
            frames, quiet_since = [], loop.time()

        while not self.proc.done:
            wait = cfg.read_block_ms / 1000
            if not started:
                wait = min(wait, max(0.001, hold_until - loop.time()))
            try:
                outputs = await self._next(wait)
            except QueueUnavailable as exc:
                if not started:
                    raise
                hint = f"resume it with GET /v1/streams/{self.spec.request_id}"
                frames.append(event(None, ApiError(503, f"{exc}; the stream broke off: {hint}"
                                                   ).body()))
                break
            if outputs is None:
                await self._client_gone()
                return
            for entry, out in outputs:
                deltas = self.proc.process(out)
                if deltas:
                    frames.append(event(entry, self.shapes.chunk(deltas)))
                if self.proc.done:
                    break
            await self._stop_finished_choices()
            if self.proc.error is not None:
                if not started:
                    raise self._refusal()
                frames.append(event(None, self._refusal().body()))
                break
            if not started and (outputs or loop.time() >= hold_until):
                await flush()
            elif frames and started:
                await flush()
            elif started and loop.time() - quiet_since >= cfg.keepalive_s:
                frames.append(b": keep-alive\n\n")
                await flush()
        await self._abort_if_running("stop_string")
        if self.spec.include_usage and self.proc.error is None and self.proc.done:
            frames.append(event(None, self.shapes.usage_chunk(self.proc)))
        self._count_usage()
        frames.append(DONE)
        await flush(more=False)
