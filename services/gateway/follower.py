"""One blocking XREAD for every output stream this gateway process follows.

An XREAD per request costs one Redis round trip per token per stream: 64 streams at 50
tokens/s would be 3,200 round trips a second. Instead one reader task blocks on XREAD
over all followed streams at once, so a scheduler step that feeds every stream costs one
round trip, and hands each stream's entries to its subscribers:

    subscribe(id, cursor) ──▶ subs {out:{id}: [Subscription]}
          │ (reader blocked?)                  │
          └─ XADD wake ─┐                       ▼
                        └──▶ reader: XREAD BLOCK out:{a} out:{b} .. wake ──▶ entries by key
                                                                             │
                             next_outputs(subs, timeout) ◀── inbox + waiter ◀┘

The wake stream is private to this process: writing to it ends the reader's current
block, so a new subscriber joins the very next read (no polling delay on the first token).

A streaming response that waits for outputs sets its subscription's pump, and the reader
calls that instead of waking the response's task:

    reader: XREAD ──▶ entries by key ──▶ sub.pump(): outputs ─▶ SSE event ─▶ send
                                              │ declined
                                              └─▶ wake the task (next_outputs returns)

so a read costs one send per stream and no task switch per stream. The pump declines when
the client's socket buffer is full (send would wait, and the reader must never wait on one
client: the task waits instead, under the send timeout) or when the outputs end the stream.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Awaitable, Callable

from services.gateway.queue import (REDIS_DOWN, QueueUnavailable, RequestQueue, read_entry,
                                    read_output)
from shared.messages import RequestOutput
from shared.redis_keys import MSG_FIELD

log = logging.getLogger("pagedserve.gateway")

WAKE_TTL_S = 3600


def stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _wake(fut: asyncio.Future | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


class Subscription:
    """One connection's view of one output stream."""

    __slots__ = ("key", "cursor", "inbox", "error", "waiter", "interrupted", "pump")

    def __init__(self, key: str, cursor: str) -> None:
        self.key = key
        self.cursor = cursor                 # last entry id handed over (or the start)
        self.inbox: list[tuple[str, RequestOutput]] = []
        self.error: QueueUnavailable | None = None
        self.waiter: asyncio.Future | None = None
        self.interrupted = False
        # Set by the connection while it waits: the reader calls it (a coroutine that must
        # not block) with the new entries in the inbox instead of waking the connection's
        # task; it returns False to have the task woken after all.
        self.pump: Callable[[], Awaitable[bool]] | None = None

    def interrupt(self) -> None:
        """The client left: the pending next_outputs() returns None."""
        self.interrupted = True
        _wake(self.waiter)


async def next_outputs(subs: list[Subscription], timeout_s: float
                       ) -> list[tuple[int, str, RequestOutput]] | None:
    """(k, entry id, output) for what subs[k] received since the last call, [] after
    timeout_s, None once interrupted. One wait covers every subscription (the prompts of
    one request). Raises QueueUnavailable when Redis failed under the reader."""
    if not any(s.inbox or s.error is not None or s.interrupted for s in subs):
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        for s in subs:
            s.waiter = waiter
        timer = loop.call_later(timeout_s, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            for s in subs:
                s.waiter = None
    if any(s.interrupted for s in subs):
        return None
    out = []
    for k, s in enumerate(subs):
        if s.error is not None and not s.inbox:
            raise s.error
        out.extend((k, e, o) for e, o in s.inbox)
        s.inbox = []
    return out


def _raw_xread(response, **_options):
    """XREAD's reply as Redis sends it: [[key, [[id, [field, value, ..]], ..]], ..]. (redis-py's
    own parser builds a dict per entry, a Python call per token on this path.)"""
    if isinstance(response, dict):          # RESP3
        return list(response.items())
    return response


class StreamFollower:
    def __init__(self, queue: RequestQueue, block_ms: int) -> None:
        self.queue, self.redis, self.block_ms = queue, queue.redis, block_ms
        # NOTE: this client's XREAD replies are raw from now on; the follower is its only
        # XREAD caller (queue.py reads single streams with XRANGE).
        self.redis.set_response_callback("XREAD", _raw_xread)
        self.wake_key = f"{queue.keys.prefix}:gateway-wake:{uuid.uuid4().hex}"
        self.wake_cursor = "0-0"
        self.subs: dict[str, list[Subscription]] = {}
        self.blocked = False                 # the reader is inside XREAD BLOCK
        self.task: asyncio.Task | None = None

    def register(self, request_id: str, cursor: str = "0-0") -> Subscription:
        """Start following out:{request_id} after `cursor`; no I/O. The reader sees it at
        its next XREAD: call `wake_into` on a pipeline that is then executed (or
        `subscribe`), and `ensure_reading`."""
        sub = Subscription(self.queue.keys.output(request_id), cursor)
        self.subs.setdefault(sub.key, []).append(sub)
        return sub

    def wake_into(self, pipe) -> None:
        """Queue the wake-up write on `pipe` if the reader is blocked on an older key set."""
        if self.blocked:
            pipe.xadd(self.wake_key, {b"w": b"1"}, maxlen=16, approximate=True)
            pipe.expire(self.wake_key, WAKE_TTL_S)

    def ensure_reading(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._read_loop())

    async def subscribe(self, request_id: str, cursor: str) -> Subscription:
        """register + wake: one round trip when the reader is blocked. Raises QueueUnavailable."""
        sub = self.register(request_id, cursor)
        if self.blocked:
            pipe = self.redis.pipeline(transaction=False)
            self.wake_into(pipe)
            try:
                await self.queue.call(pipe.execute())
            except QueueUnavailable:
                self.unsubscribe(sub)
                raise
        self.ensure_reading()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self.subs.get(sub.key)
        if subs and sub in subs:
            subs.remove(sub)
            if not subs:
                del self.subs[sub.key]

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def _read_loop(self) -> None:
        while self.subs:                     # ends when nobody follows; subscribe restarts it
            streams = {self.wake_key: self.wake_cursor}
            for key, subs in self.subs.items():
                streams[key] = (subs[0].cursor if len(subs) == 1
                                else min((s.cursor for s in subs), key=stream_id))
            self.blocked = True
            try:
                reply = await self.redis.xread(streams, count=256, block=self.block_ms)
            except Exception as exc:         # Redis down, or e.g. a key that is not a stream
                if not isinstance(exc, REDIS_DOWN):
                    log.exception("reading the output streams failed")
                err = QueueUnavailable(f"Redis at {self.queue.where} did not answer "
                                       f"({type(exc).__name__}: {str(exc)[:120]})")
                for subs in self.subs.values():
                    for s in subs:
                        s.error = err
                        _wake(s.waiter)
                self.subs.clear()            # each subscriber ends its response
                continue
            finally:
                self.blocked = False
            pumped: list[Subscription] = []
            for raw_key, entries in reply or []:
                key = raw_key.decode()
                if key == self.wake_key:
                    self.wake_cursor = entries[-1][0].decode()
                    continue
                self._deliver(self.subs.get(key, ()), entries, streams.get(key), pumped)
            for s in pumped:
                # the waiting connection writes its new entries from here (no task switch
                # per stream and read); its task is woken when it declines, or has stopped
                # waiting meanwhile
                if s.pump is not None and s.waiter is not None:
                    try:
                        if await s.pump():
                            continue
                    except Exception:        # a bug there must not stop every stream
                        log.exception("writing a stream's events from the reader failed")
                _wake(s.waiter)

    @staticmethod
    def _deliver(subs: list[Subscription], entries, read_from: str | None,
                 pumped: list[Subscription]) -> None:
        """Hand entries to the subscribers they continue: wake each one, or (when it
        waits with a pump) append it to `pumped`. NOTE: a subscriber that joined while
        this read was in flight, behind the cursor the read started from, would see a gap:
        it is left for the next read, which starts from its own cursor."""
        decoded = []
        for raw_id, flat in entries:
            if len(flat) == 2 and flat[0] == MSG_FIELD:     # an output: its one field
                out = read_output(raw_id, flat[1])
            else:
                out = read_entry(raw_id, dict(zip(flat[::2], flat[1::2])))
                if not isinstance(out, RequestOutput):
                    out = None               # the header, or an undecodable entry
            decoded.append((raw_id.decode(), out))
        for s in subs:
            if s.cursor == read_from:        # (most often: one subscriber per stream)
                fresh = decoded
            else:
                after = stream_id(s.cursor)
                if read_from is None or after < stream_id(read_from):
                    continue
                fresh = [(e, out) for e, out in decoded if stream_id(e) > after]
            if fresh:
                s.cursor = fresh[-1][0]
                s.inbox += [(e, out) for e, out in fresh if out is not None]
                if s.pump is not None and s.waiter is not None:
                    pumped.append(s)
                else:
                    _wake(s.waiter)
