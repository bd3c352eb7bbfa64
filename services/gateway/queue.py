"""The gateway's side of Redis: enqueue requests, send aborts, follow output streams.

    submit:  MULTI  XADD out:{id} h=<StreamHeader>        (the stream's first entry)
                    EXPIRE out:{id} OUTPUT_TTL_S
                    XADD requests MAXLEN ~ N m=<GenerationRequest>   (per prompt)  EXEC
    follow:  XREAD BLOCK .. out:{id} <last id> ..        (follower.py: one read, all streams)
    abort:   XADD aborts MAXLEN ~ ABORTS_MAXLEN m=<AbortRequest>
    readers: out:{id}:readers   connections following the stream (gateway-private counter)

Writing the header entry first gives every output stream a known start, so a resuming
client can be served by any replica. The readers counter lets a disconnect abort the
request only when no other connection (a resumed one) still follows it. Every Redis
failure surfaces as `QueueUnavailable`; the client reconnects by itself on the next
command, so the gateway recovers as soon as Redis is back.
"""
from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.messages import AbortRequest, GenerationRequest, RequestOutput, StreamHeader
from shared.redis_keys import (ABORTS_MAXLEN, CONSUMER_GROUP, HEADER_FIELD, MSG_FIELD,
                               OUTPUT_TTL_S, RedisKeys, redis_where)
from shared.redis_packing import packer
from shared.wire import WireError, decode, encode

log = logging.getLogger("pagedserve.gateway")

READERS_SUFFIX = ":readers"
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)


class _CPacking:
    """Mixed into the pool's connection class: commands packed in C (shared.redis_packing).
    The follower's XREAD names two arguments per followed stream on every read
    (docs/overhead.md)."""

    _packer = packer()

    def pack_command(self, *args):
        return self._packer.pack(*args)


def _packing_in_c(pool: aioredis.ConnectionPool) -> None:
    if _CPacking._packer is None:    # no hiredis: redis-py's packer
        return
    base = pool.connection_class
    pool.connection_class = type(base.__name__, (_CPacking, base), {})


class QueueUnavailable(RuntimeError):
    """Redis did not answer; the caller turns this into a 503."""


class RequestQueue:
    def __init__(self, url: str, prefix: str, request_stream_maxlen: int = 100_000,
                 socket_timeout_s: float = 5.0, max_connections: int = 64) -> None:
        self.keys = RedisKeys(prefix)
        self.maxlen = request_stream_maxlen
        # A burst of requests waits for a pooled connection rather than failing; one retry
        # on a fresh connection covers a Redis restart (the first command on a dead pooled
        # connection fails, the retry succeeds). No backoff: fail fast, answer 503.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=5.0, socket_connect_timeout=2.0,
            socket_timeout=socket_timeout_s, retry=Retry(NoBackoff(), 1))
        _packing_in_c(pool)
        self.redis = aioredis.Redis(connection_pool=pool)
        self.where = redis_where(url)

    async def close(self) -> None:
        await self.redis.aclose()
        await self.redis.connection_pool.disconnect()

    async def call(self, coro):
        """Await a Redis command; a Redis failure (down, or out of memory under its
        maxmemory) becomes QueueUnavailable, a 503."""
        try:
            return await coro
        except REDIS_DOWN as exc:
            raise QueueUnavailable(f"Redis at {self.where} did not answer "
                                   f"({type(exc).__name__}: {str(exc)[:120]})") from None
        except OutOfMemoryError:
            raise QueueUnavailable(f"Redis at {self.where} is out of memory") from None

    # ------------------------------------------------------------ requests
    async def depth(self) -> int:
        """Unfinished requests: not yet read by a scheduler (lag) + read but not acknowledged
        (pending; the scheduler acknowledges when a request finishes). Without a consumer
        group yet, every entry is waiting."""
        async def probe():
            try:
                groups = await self.redis.xinfo_groups(self.keys.requests)
            except ResponseError:            # no stream yet
                return 0
            for g in groups:
                name = g.get("name")
                if name in (CONSUMER_GROUP, CONSUMER_GROUP.encode()):
                    return int(g.get("pending") or 0) + int(g.get("lag") or 0)
            return await self.redis.xlen(self.keys.requests)
        return await self.call(probe())

    async def submit(self, requests: list[GenerationRequest], headers: list[StreamHeader],
                     also=None) -> list[str]:
        """Enqueue every request (one per prompt) in one transaction; returns their header
        entries' ids. `also(pipe)` may add commands to the same round trip (the follower's
        wake-up)."""
        pipe = self.redis.pipeline(transaction=True)
        if also is not None:
            also(pipe)
        first = len(pipe.command_stack)
        for request, header in zip(requests, headers):
            out = self.keys.output(request.request_id)
            pipe.xadd(out, {HEADER_FIELD: encode(header)})
            pipe.expire(out, OUTPUT_TTL_S)
            pipe.incr(out + READERS_SUFFIX)
            pipe.expire(out + READERS_SUFFIX, OUTPUT_TTL_S)
            pipe.xadd(self.keys.requests, {MSG_FIELD: encode(request)}, maxlen=self.maxlen,
                      approximate=True)
        replies = await self.call(pipe.execute())
        return [r.decode() for r in replies[first::5]]

    async def exists(self, request_id: str) -> bool:
        """Whether request_id already has an output stream (a client-chosen id reused)."""
        return bool(await self.call(self.redis.exists(self.keys.output(request_id))))

    async def abort(self, request_id: str, reason: str, index: int = -1) -> None:
        """Best effort: a lost abort only costs the scheduler the rest of max_tokens.
        `index` >= 0 stops one sequence (choice) of the request, -1 all of it."""
        msg = encode(AbortRequest(request_id, reason, index))
        try:
            await self.call(self.redis.xadd(self.keys.aborts, {MSG_FIELD: msg},
                                             maxlen=ABORTS_MAXLEN, approximate=True))
        except QueueUnavailable as exc:
            log.warning("abort of %s not sent: %s", request_id, exc)

    async def attach(self, request_id: str) -> None:
        """A resumed connection follows the stream too."""
        key = self.keys.output(request_id) + READERS_SUFFIX
        pipe = self.redis.pipeline(transaction=False)
        pipe.incr(key)
        pipe.expire(key, OUTPUT_TTL_S)
        await self.call(pipe.execute())

    async def detach(self, request_id: str) -> int:
        """A connection left; returns how many still follow (<= 0: none)."""
        return await self.call(self.redis.decr(self.keys.output(request_id) + READERS_SUFFIX))

    async def readers(self, request_id: str) -> int:
        value = await self.call(self.redis.get(self.keys.output(request_id) + READERS_SUFFIX))
        return int(value or 0)

    # ------------------------------------------------------------ outputs
    async def header(self, request_id: str) -> tuple[str, StreamHeader] | None:
        """(entry id, header) of a request's output stream, or None if unknown or expired."""
        entries = await self.call(self.redis.xrange(self.keys.output(request_id), count=1))
        if not entries:
            return None
        header = read_entry(entries[0][0], entries[0][1])
        return (entries[0][0].decode(), header) if isinstance(header, StreamHeader) else None

    async def range(self, request_id: str, after: str, upto: str, count: int = 256
                    ) -> tuple[str, list[tuple[str, RequestOutput]]]:
        """(new cursor, outputs with after < id <= upto): replay for a resuming client."""
        entries = await self.call(self.redis.xrange(self.keys.output(request_id),
                                                     min="(" + after, max=upto, count=count))
        return _outputs(after, entries)

    # ------------------------------------------------------------ fleet
    async def scheduler_status(self) -> tuple[dict[str, float], dict[str, str], float]:
        """(name -> last heartbeat, name -> why it cannot serve, now) of every scheduler;
        heartbeats and now are in the Redis server's clock."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.schedulers)
        pipe.hgetall(self.keys.degraded)
        pipe.time()
        beats, degraded, (secs, usecs) = await self.call(pipe.execute())
        out = {}
        for name, value in beats.items():
            try:
                out[name.decode()] = float(value)
            except ValueError:
                continue
        return (out, {k.decode(): v.decode(errors="replace") for k, v in degraded.items()},
                secs + usecs / 1e6)

    async def outputs_exist(self, request_ids: list[str]) -> bool:
        """Whether every request's output stream still exists (Redis restarted without its
        data: the request is lost, and nothing will ever be written there)."""
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.exists(self.keys.output(rid))
        return all(await self.call(pipe.execute()))

    async def scheduler_metrics(self) -> list[tuple[str, str]]:
        """(scheduler name, Prometheus text) for every scheduler that published recently."""
        async def collect():
            names = sorted([k async for k in self.redis.scan_iter(
                match=self.keys.metrics_pattern, count=100)])
            return names, (await self.redis.mget(names) if names else [])

        names, values = await self.call(collect())
        cut = len(self.keys.metrics(""))
        return [(k.decode()[cut:], v.decode(errors="replace")) for k, v in zip(names, values)
                if v is not None]


def read_entry(entry_id: bytes, fields: dict) -> StreamHeader | RequestOutput | None:
    """What one output-stream entry holds: the stream's header (its first entry, field
    HEADER_FIELD), an output (MSG_FIELD), or None when it cannot be read (logged)."""
    data = fields.get(MSG_FIELD)
    if data is not None:
        return read_output(entry_id, data)
    data = fields.get(HEADER_FIELD)
    if data is not None:
        try:
            return decode(data, StreamHeader)
        except WireError as exc:
            log.warning("skipping undecodable output-stream entry %s: %s", entry_id.decode(), exc)
    return None


def read_output(entry_id: bytes, data: bytes) -> RequestOutput | None:
    """An output entry's RequestOutput (its MSG_FIELD's bytes), or None (logged)."""
    try:
        return decode(data, RequestOutput)
    except WireError as exc:
        log.warning("skipping undecodable output-stream entry %s: %s", entry_id.decode(), exc)
        return None


def _outputs(cursor: str, entries) -> tuple[str, list[tuple[str, RequestOutput]]]:
    out = []
    for raw_id, fields in entries:
        cursor = raw_id.decode()
        msg = read_entry(raw_id, fields)
        if isinstance(msg, RequestOutput):
            out.append((cursor, msg))
    return cursor, out
