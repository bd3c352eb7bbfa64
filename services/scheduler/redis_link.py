"""The scheduler's link to Redis: one pipelined round trip per iteration, typed batches.

    round(outputs, acks, heartbeat, want)
      out   RequestOutputs          XADD {prefix}:out:{id}, EXPIRE (all in one EVAL)
            acks of ended requests  XACK + XDEL of their request-stream entries
            Heartbeat               HSET/HDEL of the liveness and health hashes, SET metrics
      in    Inbound                 new requests (XREADGROUP, at most `want`), aborts (XREAD)

Every command queued on the pipeline is queued with the handler of its reply, so replies are
never read by a position that depends on what was asked. Key names: shared/redis_keys.py.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import msgpack
import redis

from shared.messages import AbortRequest, GenerationRequest, RequestOutput
from shared.redis_keys import (CONSUMER_GROUP, FINISHED_OUTPUT_TTL_S, MSG_FIELD, OUTPUT_TTL_S,
                               RedisKeys)
from shared.wire import WireError, decode, encode

log = logging.getLogger("pagedserve.scheduler")


@dataclass(slots=True)
class Inbound:
    """What one round read."""

    requests: list[tuple[str, GenerationRequest]] = field(default_factory=list)  # (entry id, _)
    malformed: list[str] = field(default_factory=list)    # request entry ids to acknowledge
    # (request id, why) of the undecodable entries that still name their request: their
    # client is answered with an error instead of waiting forever
    refused: list[tuple[str, str]] = field(default_factory=list)
    aborts: list[AbortRequest] = field(default_factory=list)


@dataclass(slots=True)
class Heartbeat:
    """This scheduler's liveness (unix seconds), health and metrics, written in a round."""

    now: float
    degraded: str | None = None          # why /health should say degraded; None: healthy
    metrics: bytes | None = None         # Prometheus exposition, kept 15 s


# Every output of a round in one command: XADD + EXPIRE per stream run inside Redis, so the
# cost per output on both sides is two arguments, not two pipelined commands (each one
# packed, parsed and answered). EVAL, not EVALSHA: a restarted Redis needs no reload.
#   KEYS: the output streams   ARGV: field, ttl, finished ttl, then (payload, finished) per key
PUBLISH_LUA = """
local field, ttl, finished_ttl = ARGV[1], ARGV[2], ARGV[3]
for i, key in ipairs(KEYS) do
  redis.call('XADD', key, '*', field, ARGV[2 + 2 * i])
  redis.call('EXPIRE', key, ARGV[3 + 2 * i] == '1' and finished_ttl or ttl)
end
return #KEYS
"""


def _request_id_of(raw) -> str | None:
    """The request id of an entry that does not decode as a GenerationRequest (another wire
    version, say), when its envelope still holds one: [version, type, request_id, ...]."""
    try:
        body = msgpack.unpackb(raw, raw=False)
        return body[2] if isinstance(body[2], str) and body[2] else None
    except Exception:
        return None


def _str(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


class RedisLink:
    def __init__(self, client: redis.Redis, keys: RedisKeys, name: str) -> None:
        self.redis = client
        self.keys = keys
        self.name = name                 # this scheduler's consumer name
        self.abort_cursor = "0"          # every scheduler reads every abort
        # Redis server time minus this host's (s), measured by every round: heartbeats are
        # written and compared in the server's clock, so hosts' clocks need not agree.
        self.clock_offset = 0.0

    def now(self) -> float:
        """The Redis server's clock (unix seconds), as of the last round's measurement."""
        return time.time() + self.clock_offset

    def sync_clock(self) -> None:
        self._take_time(self.redis.time(), None)

    def _take_time(self, reply, _inbound) -> None:
        secs, usecs = reply
        self.clock_offset = secs + usecs / 1e6 - time.time()

    def ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(self.keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def round(self, outputs: list[RequestOutput], acks: list[str], beat: Heartbeat | None,
              read: bool = True, want: int = 0) -> Inbound:
        """Publish, acknowledge, beat, then (when `read`) read aborts and up to `want` new
        requests, in one round trip. Raises redis.ConnectionError / TimeoutError when Redis
        is unreachable: then nothing was taken, and the caller keeps its outputs and acks."""
        pipe = self.redis.pipeline(transaction=False)
        handlers: list[Callable | None] = []

        def queue(command: Callable, *args, handler: Callable | None = None, **kw) -> None:
            command(*args, **kw)
            handlers.append(handler)

        if outputs:
            keys = [self.keys.output(out.request_id) for out in outputs]
            args = [MSG_FIELD, OUTPUT_TTL_S, FINISHED_OUTPUT_TTL_S]
            for out in outputs:
                args += (encode(out), 1 if out.finished else 0)
            queue(pipe.eval, PUBLISH_LUA, len(keys), *keys, *args)
        if acks:
            # An ended request's entry is not needed any more: deleting it keeps the request
            # stream as long as the unfinished work (the group's lag stays exact: only entries
            # before its last-delivered id are deleted).
            queue(pipe.xack, self.keys.requests, CONSUMER_GROUP, *acks)
            queue(pipe.xdel, self.keys.requests, *acks)
        if beat is not None:
            self._queue_beat(queue, pipe, beat)
        queue(pipe.time, handler=self._take_time)
        inbound = Inbound()
        if read:
            queue(pipe.xread, {self.keys.aborts: self.abort_cursor}, count=1000,
                  handler=self._take_aborts)
            if want:
                queue(pipe.xreadgroup, CONSUMER_GROUP, self.name, {self.keys.requests: ">"},
                      count=want, handler=self._take_requests)
        for handler, reply in zip(handlers, pipe.execute(raise_on_error=False)):
            if isinstance(reply, redis.ResponseError) and "NOGROUP" in str(reply):
                # Redis lost its data (a restart): what was published went out; the group
                # is made again and read in the next round.
                log.warning("request group vanished (Redis restarted?); recreating it")
                self.ensure_group()
            elif isinstance(reply, Exception):
                raise reply
            elif handler is not None:
                handler(reply, inbound)
        return inbound

    def wait_for_requests(self, want: int, block_ms: int) -> Inbound:
        """Block up to `block_ms` for new requests (the loop's idle wait: no busy spin)."""
        inbound = Inbound()
        self._take_requests(self.redis.xreadgroup(CONSUMER_GROUP, self.name,
                                                  {self.keys.requests: ">"}, count=want,
                                                  block=block_ms), inbound)
        return inbound

    def beat(self, beat: Heartbeat) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self._queue_beat(lambda command, *a, **kw: command(*a, **kw), pipe, beat)
        pipe.execute()

    def _queue_beat(self, queue: Callable, pipe, beat: Heartbeat) -> None:
        queue(pipe.hset, self.keys.schedulers, self.name, f"{beat.now:.3f}")
        if beat.degraded:
            queue(pipe.hset, self.keys.degraded, self.name, beat.degraded)
        else:
            queue(pipe.hdel, self.keys.degraded, self.name)
        if beat.metrics is not None:
            queue(pipe.set, self.keys.metrics(self.name), beat.metrics, ex=15)

    # ------------------------------------------------------------ taking over
    def dead_schedulers(self, now: float, silent_s: float = 10.0) -> list[str]:
        """Consumers whose heartbeat is older than `silent_s`, or that never beat."""
        beats = {_str(k): float(v) for k, v in self.redis.hgetall(self.keys.schedulers).items()}
        dead = [n for n, t in beats.items() if n != self.name and now - t > silent_s]
        try:
            consumers = [_str(c["name"]) for c in self.redis.xinfo_consumers(
                self.keys.requests, CONSUMER_GROUP)]
        except redis.ResponseError:
            consumers = []
        return dead + [c for c in consumers if c not in beats and c != self.name]

    def take_pending(self, name: str) -> Inbound:
        """The requests `name` read and never acknowledged, now this scheduler's (a dead
        consumer is removed from the group and from the heartbeats)."""
        pending = self.redis.xpending_range(self.keys.requests, CONSUMER_GROUP, "-", "+",
                                            10_000, consumername=name)
        ids = [p["message_id"] for p in pending]
        if name != self.name:
            if ids:
                self.redis.xclaim(self.keys.requests, CONSUMER_GROUP, self.name, 0, ids)
            self.redis.xgroup_delconsumer(self.keys.requests, CONSUMER_GROUP, name)
            self.redis.hdel(self.keys.schedulers, name)
        inbound = Inbound()
        if ids:
            wanted = {_str(i) for i in ids}
            entries = self.redis.xrange(self.keys.requests, ids[0], ids[-1])
            self._take_requests([(self.keys.requests,
                                  [(e, f) for e, f in entries if _str(e) in wanted])], inbound)
        return inbound

    def published(self, request_id: str) -> tuple[dict[int, list[int]], set[int], bool]:
        """What schedulers already published for this request: the tokens of each sample
        index, the indices that finished, and whether the request finished. (The gateway's
        header entry in the same stream is not an output.)"""
        tokens: dict[int, list[int]] = {}
        ended: set[int] = set()
        finished = False
        for _eid, fields in self.redis.xrange(self.keys.output(request_id)):
            if MSG_FIELD not in fields:
                continue
            out = decode(fields[MSG_FIELD], RequestOutput)
            finished = finished or out.finished
            for delta in out.seqs:
                tokens.setdefault(delta.index, []).extend(delta.token_ids)
                if delta.finish_reason is not None:
                    ended.add(delta.index)
        return tokens, ended, finished

    # ------------------------------------------------------------ replies
    def _take_aborts(self, reply, inbound: Inbound) -> None:
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self.abort_cursor = _str(entry_id)
                try:
                    inbound.aborts.append(decode(fields[MSG_FIELD], AbortRequest))
                except (WireError, KeyError):
                    log.warning("ignoring malformed abort %s", self.abort_cursor)

    @staticmethod
    def _take_requests(reply, inbound: Inbound) -> None:
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                eid = _str(entry_id)
                try:
                    inbound.requests.append((eid, decode(fields[MSG_FIELD], GenerationRequest)))
                except (WireError, KeyError) as exc:
                    log.warning("refusing malformed request entry %s: %s", eid, exc)
                    inbound.malformed.append(eid)
                    request_id = _request_id_of(fields.get(MSG_FIELD))
                    if request_id is not None:
                        inbound.refused.append((request_id, f"the scheduler cannot read this "
                                                            f"request: {exc}"))
