"""Answering one generation request from its Redis output streams: SSE events or one JSON body.

A request has one output stream per prompt (/v1/completions takes several prompts); the
response merges them, choices numbered prompt_index * n + j, usage summed.

Plain SSE by default, as OpenAI and vLLM send it: `data: {...}` events, then `data: [DONE]`,
nothing else; what several outputs read at once add to a choice goes in one event (a
client that fell behind catches up instead of getting one event per token). A client that
sends `X-Resumable-Stream: true` (one prompt) gets a resumable stream instead: every event
made from a Redis entry carries `id: <entry id>`, a `: keep-alive` comment follows each
keepalive_s of silence, and the request outlives a dropped connection by resume_grace_s:

    id: <header entry>   chat only: {"delta": {"role": "assistant"}} for every choice
    id: <entry 1>        choices that changed in RequestOutput 1
    ...
    id: <final entry>    the last deltas with finish_reason
                         usage chunk (stream_options.include_usage), then [DONE]: no id

Resumption: GET /v1/streams/{request_id} with `Last-Event-ID: <id>` (or the query
parameter `last_event_id`) replays the stream silently up to that id, rebuilding the
detokenizer and stop-string state, then streams what follows exactly as the first
connection would have (same ids, same text). Without an id it streams from the start.
Any replica can serve it: the stream's header entry holds the `StreamHeader`.

Outputs arrive through the process-wide `StreamFollower` (one XREAD for all streams); once
an SSE response has started, the follower's reader builds and sends its events itself
(`_pump`) while the response's task waits, and wakes the task only for what needs it: the
end of the stream, an error, a stop string to abort, or a client whose socket is full.
Disconnects are watched all along: the client's `http.disconnect` ends the wait for the
next output at once. A plain request is then aborted at once (every prompt of it). A
resumable one keeps running: the gateway goes on reading its outputs for resume_grace_s
and aborts it only if it is still running then and no connection follows it again.
"""
from __future__ import annotations

import asyncio
import logging
import time

from services.gateway.follower import Subscription, next_outputs, stream_id
from services.gateway.limits import BODY_WRITER, WRITABLE
from services.gateway.output import ChoiceDelta, OutputProcessor, join, usage_of
from services.gateway.queue import QueueUnavailable
from services.gateway.responses import Shapes, dumps
from services.gateway.validation import ApiError
from shared.messages import StreamHeader

log = logging.getLogger("pagedserve.gateway")

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
DONE = b"data: [DONE]\n\n"
RESUMABLE_HEADER = "x-resumable-stream"     # request header that opts in (value "true" or "1")
GRACE_POLL_S = 0.25                         # during the grace period: how often readers are read


def event(entry_id: str | None, body: dict | bytes) -> bytes:
    """One SSE event; `body` a JSON object, or its bytes already encoded."""
    data = body if isinstance(body, bytes) else dumps(body)
    if entry_id:
        return b"id: " + entry_id.encode() + b"\ndata: " + data + b"\n\n"
    return b"data: " + data + b"\n\n"


class Part:
    """One prompt's output stream and its state on this connection."""

    __slots__ = ("spec", "header_id", "sub", "proc")

    def __init__(self, spec: StreamHeader, header_id: str, sub: Subscription | None,
                 vocab) -> None:
        self.spec, self.header_id, self.sub = spec, header_id, sub
        self.proc = OutputProcessor(spec, vocab)


class GenerationStream:
    """The ASGI response of a generation (or of a resumed stream)."""

    def __init__(self, gw, response_id: str, parts: list[Part], *, resumed: bool = False,
                 last_event_id: str | None = None, echo_request_id: str | None = None) -> None:
        self.gw, self.parts, self.response_id = gw, parts, response_id
        self.spec = parts[0].spec
        self.resumed, self.last_event_id = resumed, last_event_id
        self.resumable = resumed or self.spec.resumable
        self.procs = [p.proc for p in parts]
        self.shapes = Shapes(self.spec, gw.vocab, response_id)
        self.cursor = parts[0].header_id    # resumed: where following the stream starts
        self.gone = False                   # the client disconnected
        # the response's X-Request-Id: the client's own when it sent one
        self.x_request_id = (echo_request_id or response_id).encode()
        self.started_at = self.last_news = time.monotonic()
        self.frames: list[bytes] = []       # SSE events built and not yet sent
        self.quiet_since = 0.0              # (loop time) when the last SSE bytes were sent
        self.send = None                    # the ASGI send of the SSE body, once started
        self.writable = None                # the connection's limits.Writable (if any)
        self.direct = None                  # the request's limits.BodyWriter (if any)
        self.pump_error: Exception | None = None
        self.loop: asyncio.AbstractEventLoop | None = None     # set by _sse

    @property
    def done(self) -> bool:
        for p in self.procs:
            if not p.done:
                return False
        return True

    def _error(self) -> tuple[str, int] | None:
        return next((p.error for p in self.procs if p.error is not None), None)

    async def __call__(self, scope, receive, send) -> None:
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.gone = True
            for part in self.parts:
                if part.sub is not None:
                    part.sub.interrupt()

        watcher = asyncio.ensure_future(watch())
        self.writable = scope.get(WRITABLE)
        # NOTE: SSE body pieces go straight to the socket where the server allows it, past
        # the middleware; none of ours changes a body (one that did would need this off).
        self.direct = scope.get(BODY_WRITER)
        self.gw.metrics.streams.inc()
        try:
            if self.resumed:
                part = self.parts[0]
                await self.gw.queue.attach(part.spec.request_id)
                await self._replay()
                part.sub = await self.gw.follower.subscribe(part.spec.request_id, self.cursor)
            if self.spec.stream or self.resumed:
                await self._sse(send)
            else:
                await self._unary(send)
        finally:
            watcher.cancel()
            for part in self.parts:
                if part.sub is not None:
                    self.gw.follower.unsubscribe(part.sub)
            self.gw.metrics.streams.dec()

    # ------------------------------------------------------------ reading
    async def _next(self, wait_s: float):
        """New (part, entry id, output)s, [] after wait_s, None once the client has gone."""
        if self.gone:
            return None
        outputs = await next_outputs([p.sub for p in self.parts], wait_s)
        now, cfg = time.monotonic(), self.gw.config
        if outputs:
            self.last_news = now
        elif now - self.last_news >= cfg.stall_check_s and not self.done:
            self.last_news = now                  # the next check after as long again
            await self._check_alive()
        if now - self.started_at > cfg.request_timeout_s and not self.done:
            self._fail(f"the request ran longer than the server's limit of "
                       f"{cfg.request_timeout_s:g} s", 504)
        return outputs

    async def _check_alive(self) -> None:
        """A stream with no news for stall_check_s: is anything still working on it? (A
        scheduler restart, or an executor restart, only pauses it: both continue it.)"""
        why = await self.gw.scheduler_gone()
        running = [p.spec.request_id for p in self.parts if not p.proc.done]
        if why is None and not await self.gw.queue.outputs_exist(running):
            why = ("the request was lost: Redis restarted without its data; retry the "
                   "request")
        if why is not None:
            self._fail(why, 503)

    def _fail(self, message: str, status: int) -> None:
        """End the response with this error (the loops then abort what still runs)."""
        proc = next(p for p in self.procs if not p.done)
        proc.error = (message, status)

    async def _client_gone(self) -> None:
        """A plain request is aborted now; a resumable one after resume_grace_s, if it is
        still running then and no connection follows it.

        While a resumable request runs on, this response does not end: the request keeps
        its key's budget share (held until the response ends, budgets.Holding) until it
        finishes, whichever connection follows it meanwhile."""
        queue = self.gw.queue
        if not self.resumable:
            for part in self.parts:
                await self._abort_if_running(part, "client_disconnected")
            return
        part = self.parts[0]
        rid = part.spec.request_id
        try:
            if part.proc.scheduler_finished:
                return
            followed = await queue.detach(rid) > 0
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.gw.config.resume_grace_s
            part.sub.interrupted = False
            while followed or loop.time() < deadline:
                for _k, _entry, out in await next_outputs([part.sub], GRACE_POLL_S):
                    if not followed:
                        part.proc.process(out)
                    elif out.finished or out.error:   # the resumed connection answers it
                        return
                if part.proc.scheduler_finished:
                    return
                if not followed:
                    await self._stop_finished_choices()
                    if part.proc.done:
                        break
                    # a resumed connection follows it now: it aborts it if it drops too
                    followed = await queue.readers(rid) > 0
                if part.sub.error is not None or (
                        time.monotonic() - self.started_at > self.gw.config.request_timeout_s):
                    return
        except QueueUnavailable:
            pass
        await self._abort_if_running(part, "client_disconnected")

    async def _stop_finished_choices(self) -> None:
        """n > 1: a choice that ended at a stop string stops its sequence in the scheduler,
        so that it no longer takes a batch slot while the other choices go on. (When every
        choice is done, one abort of the whole request does that instead.)"""
        for part in self.parts:
            proc = part.proc
            stopped, proc.stopped_here = proc.stopped_here, []
            if not proc.done and not proc.scheduler_finished:
                for index in stopped:
                    self.gw.metrics.aborts.labels("stop_string_choice").inc()
                    await self.gw.queue.abort(part.spec.request_id, "stop_string", index)

    async def _abort_if_running(self, part: Part, reason: str) -> None:
        if not part.proc.scheduler_finished:
            part.proc.scheduler_finished = True
            self.gw.metrics.aborts.labels(reason).inc()
            await self.gw.queue.abort(part.spec.request_id, reason)

    async def _abort_all(self, reason: str) -> None:
        for part in self.parts:
            await self._abort_if_running(part, reason)

    def _refusal(self) -> ApiError:
        message, status = self._error()
        return ApiError(status, message, code="request_refused" if status < 500 else None)

    def _count_usage(self) -> None:
        if not self.resumed and self.done and self._error() is None:
            self.gw.metrics.tokens.inc(usage_of(self.procs)["completion_tokens"])

    def _process(self, k: int, out) -> list[ChoiceDelta]:
        return self.parts[k].proc.process(out)

    # ------------------------------------------------------------ one JSON body
    async def _unary(self, send) -> None:
        deltas: dict[int, list[ChoiceDelta]] = {}
        while not self.done:
            outputs = await self._next(self.gw.config.read_block_ms / 1000)
            if outputs is None:
                await self._client_gone()
                return
            for k, _entry, out in outputs:
                if self.parts[k].proc.done:
                    continue
                for d in self._process(k, out):
                    deltas.setdefault(d.index, []).append(d)
            if self._error() is not None:
                break
            await self._stop_finished_choices()
        await self._abort_all("stop_string" if self._error() is None else "sibling_refused")
        if self._error() is not None:
            raise self._refusal()
        self._count_usage()
        body = dumps(self.shapes.whole(self.procs, deltas))
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"x-request-id", self.x_request_id)]})
        await send({"type": "http.response.body", "body": body})

    # ------------------------------------------------------------ server-sent events
    async def _replay(self) -> None:
        """Resuming: rebuild the state the first connection had at Last-Event-ID."""
        part = self.parts[0]
        upto = self.last_event_id
        if upto is None or stream_id(upto) <= stream_id(part.header_id):
            return
        cursor = part.header_id
        while not part.proc.done:
            new, outputs = await self.gw.queue.range(part.spec.request_id, cursor, upto)
            if new == cursor:
                break
            cursor = new
            for _entry, out in outputs:
                part.proc.process(out)
                if part.proc.done:
                    break
        part.proc.stopped_here = []     # the first connection stopped those choices
        self.cursor = upto

    def _usage_so_far(self) -> dict | None:
        """stream_options.continuous_usage_stats: every chunk carries the usage so far."""
        return usage_of(self.procs) if self.spec.continuous_usage else None

    def _event_per_entry(self, outputs, frames: list[bytes]) -> None:
        """Resumable: one event per Redis entry, its id the entry's, so that every reader
        of the stream (live, replaying or resumed) gets the very same events."""
        for k, entry, out in outputs:
            if self.parts[k].proc.done:
                continue
            deltas = self._process(k, out)
            if deltas:
                frames.append(event(entry, self.shapes.chunk(deltas, self._usage_so_far())))

    def _coalesce(self, outputs, frames: list[bytes]) -> None:
        """Plain SSE: one event for everything the outputs read at once add to each choice.
        A client (or this gateway) that fell behind gets several tokens per event, as vLLM
        sends them, instead of an event per token that would keep it behind."""
        if len(outputs) == 1:                    # (most reads: one output, as below)
            k, _entry, out = outputs[0]
            deltas = [] if self.parts[k].proc.done else self._process(k, out)
        else:
            merged: dict[int, ChoiceDelta] = {}  # choice index -> what it gained
            for k, _entry, out in outputs:
                if not self.parts[k].proc.done:
                    for d in self._process(k, out):
                        merged[d.index] = join(merged[d.index], d) if d.index in merged else d
            deltas = [merged[i] for i in sorted(merged)]
        if deltas:
            body = self.shapes.text_chunk(deltas[0]) if len(deltas) == 1 else None
            frames.append(event(None, body or self.shapes.chunk(deltas, self._usage_so_far())))

    def _build(self, outputs) -> None:
        if self.resumable:                   # event ids only on resumable streams
            self._event_per_entry(outputs, self.frames)
        else:
            self._coalesce(outputs, self.frames)

    async def _pump(self) -> bool:
        """Called by the follower's reader while _sse waits for outputs, with new ones in
        the inbox: build their event and send it from there, unless the client's socket
        is full (send would wait) or the outputs need _sse (the stream ended, an error, a
        stop string to abort): then it returns False and the reader wakes _sse."""
        if self.gone or self.writable.paused:
            return False
        part = self.parts[0]                 # (one part: _sse sets a pump only then)
        if part.sub.inbox:
            outputs = [(0, entry, out) for entry, out in part.sub.inbox]
            part.sub.inbox = []
            self.last_news = time.monotonic()
            self._build(outputs)
        if part.proc.done or part.proc.stopped_here:     # (done: also on an error)
            return False
        if self.frames:
            body, self.frames = b"".join(self.frames), []
            self.quiet_since = self.loop.time()
            if self.direct is not None and self.direct.write(body):
                return True
            try:
                await self.send({"type": "http.response.body", "body": body, "more_body": True})
            except Exception as exc:         # raised in _sse, on the response's own task
                self.pump_error = exc
                return False
        return True

    async def _sse(self, send) -> None:
        cfg, loop = self.gw.config, asyncio.get_running_loop()
        self.loop = loop                     # (_pump's clock: no lookup per event)
        ids = self.resumable                 # event ids only on resumable streams
        header_id = self.parts[0].header_id
        if self.spec.kind == "chat" and (self.last_event_id is None or
                                         stream_id(self.last_event_id) < stream_id(header_id)):
            indices = [p.base + j for p in self.procs for j in range(p.spec.n)]
            self.frames.append(event(header_id if ids else None,
                                     self.shapes.role_chunk(indices, self._usage_so_far())))
        # A fresh stream holds its headers briefly: a refusal then becomes an HTTP status.
        started = False
        hold_until = loop.time() + (0.0 if self.resumed else cfg.stream_start_wait_s)
        self.quiet_since = loop.time()
        # Once started, the follower's reader may send what arrives while this waits (one
        # part only, and only on a server that says when its socket is full).
        sub = self.parts[0].sub if len(self.parts) == 1 and self.writable is not None else None

        async def flush(more: bool = True) -> None:
            nonlocal started
            if not started:
                started = True
                headers = [*SSE_HEADERS, (b"x-request-id", self.x_request_id)]
                if self.resumable:
                    headers.append((RESUMABLE_HEADER.encode(), b"true"))
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                self.send = send
            body, self.frames = b"".join(self.frames), []
            self.quiet_since = loop.time()
            if more and self.direct is not None and self.direct.write(body):
                return
            await send({"type": "http.response.body", "body": body, "more_body": more})

        while not self.done:
            wait = cfg.read_block_ms / 1000
            if not started:
                wait = min(wait, max(0.001, hold_until - loop.time()))
            elif sub is not None:
                sub.pump = self._pump
            try:
                outputs = await self._next(wait)
            except QueueUnavailable as exc:
                if not started:
                    raise
                hint = (f"resume it with GET /v1/streams/{self.spec.request_id}"
                        if self.resumable else "retry the request")
                self.frames.append(event(None, ApiError(
                    503, f"{exc}; the stream broke off: {hint}").body()))
                break
            finally:
                if sub is not None:
                    sub.pump = None
            if self.pump_error is not None:
                raise self.pump_error
            if outputs is None:
                await self._client_gone()
                return
            if outputs:
                self._build(outputs)
            await self._stop_finished_choices()
            if self._error() is not None:
                if not started:
                    raise self._refusal()
                self.frames.append(event(None, self._refusal().body()))
                break
            if not started and (outputs or loop.time() >= hold_until):
                await flush()
            elif self.frames and started:
                await flush()
            elif started and self.resumable and loop.time() - self.quiet_since >= cfg.keepalive_s:
                self.frames.append(b": keep-alive\n\n")
                await flush()
        await self._abort_all("stop_string" if self._error() is None else "sibling_refused")
        if self.spec.include_usage and self._error() is None and self.done:
            self.frames.append(event(None, self.shapes.usage_chunk(self.procs)))
        self._count_usage()
        self.frames.append(DONE)
        await flush(more=False)
