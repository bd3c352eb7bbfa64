"""The scheduler's link to Redis: one pipelined round trip per iteration, typed batches.

    round(outputs, acks, heartbeat, want)
      out   encoded RequestOutputs  XADD {prefix}:out:{id} (+ EXPIRE)     } one script, run only
            acks of ended requests  XACK + XDEL of their request-stream entries } while this
                                                                          process holds its claim
            Heartbeat               HSET/HDEL of the liveness and health hashes, SET metrics
      in    Inbound                 new requests (XREADGROUP, at most `want`), aborts (XREAD)

Every command queued on the pipeline is queued with the handler of its reply, so replies are
never read by a position that depends on what was asked. Key names: shared/redis_keys.py.

An output stream's TTL (OUTPUT_TTL_S after its last write) is set by a request's first
output in this process, then again only once TTL_REFRESH_S has passed since (and to
FINISHED_OUTPUT_TTL_S by its last output): an EXPIRE costs Redis about as much as the
XADD it would follow (docs/overhead.md). A stream therefore lives at least
OUTPUT_TTL_S - TTL_REFRESH_S after its last write. A round that fails sets no TTL and
records none; a round that finds Redis without its data (the claim key gone) sets the TTL
of every stream it writes.

One writer per output stream: a scheduler that takes over another's pending requests first
marks the other's claim key taken, and every publication checks, in the same script that
writes, that the claim still holds this process's token. A scheduler stalled past the
heartbeat timeout (SIGSTOP, a swapped-out host) therefore cannot write into a stream its
successor now continues: its first round after waking raises ClaimLost instead.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import msgpack
import redis

from shared.messages import AbortRequest, GenerationRequest, RequestOutput
from shared.redis_keys import (CONSUMER_GROUP, FINISHED_OUTPUT_TTL_S, MSG_FIELD, OUTPUT_TTL_S,
                               RedisKeys)
from shared.wire import WireError, decode

if TYPE_CHECKING:
    from services.scheduler.outputs import Outgoing

log = logging.getLogger("pagedserve.scheduler")


TTL_REFRESH_S = 60.0      # an output stream's TTL is set again at most this often (above)


class ClaimLost(RuntimeError):
    """Another scheduler took over this one's requests: publish nothing more."""


# KEYS: claim key, request stream, output streams...   ARGV: token, group, field, n outputs,
# then (payload, ttl) per output (a negative ttl: leave the stream's TTL as it is, unless
# Redis lost its data), then the acknowledged entry ids.
# Returns 0 (nothing written) when the claim holds another token. A missing claim key (Redis
# restarted without its data) is taken back: no one else can hold what that Redis lost; the
# streams written then all get their TTL (-ttl), and it returns 2.
# NOTE: the shebang makes Redis (>= 7) refuse the whole script while it is over maxmemory,
# rather than fail it halfway: either every output of a round is written or none.
_PUBLISH = """#!lua
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then return 0 end
if not held then redis.call('SET', KEYS[1], ARGV[1]) end
local n = tonumber(ARGV[4])
for i = 1, n do
  redis.call('XADD', KEYS[2 + i], '*', ARGV[3], ARGV[3 + 2 * i])
  local ttl = tonumber(ARGV[4 + 2 * i])
  if ttl > 0 or not held then
    redis.call('EXPIRE', KEYS[2 + i], math.abs(ttl))
  end
end
for j = 5 + 2 * n, #ARGV do
  redis.call('XACK', KEYS[2], ARGV[2], ARGV[j])
  redis.call('XDEL', KEYS[2], ARGV[j])
end
if not held then return 2 end
return 1
"""


@dataclass(slots=True)
class Inbound:
    """What one round read."""

    requests: list[tuple[str, GenerationRequest]] = field(default_factory=list)  # (entry id, _)
    malformed: list[str] = field(default_factory=list)    # request entry ids to acknowledge
    # (request id, why) of the undecodable entries that still name their request: their
    # client is answered with an error instead of waiting forever
    refused: list[tuple[str, str]] = field(default_factory=list)
    aborts: list[AbortRequest] = field(default_factory=list)
    # Why nothing of the round's outputs and acks was written (Redis over its maxmemory,
    # or restarted without the script): the caller keeps them for the next round
    held: str | None = None


@dataclass(slots=True)
class Heartbeat:
    """This scheduler's liveness (unix seconds), health and metrics, written in a round."""

    now: float
    degraded: str | None = None          # why /health should say degraded; None: healthy
    metrics: bytes | None = None         # Prometheus exposition, kept 15 s


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
        # This process's claim on the requests read under `name` (set by hold_claim).
        self.token = f"{name}/{uuid.uuid4().hex}"
        self._publish_sha: str | None = None     # loaded on first use (and after a restart)
        self.abort_cursor = "0"          # every scheduler reads every abort
        # Redis server time minus this host's (s), measured by every round: heartbeats are
        # written and compared in the server's clock, so hosts' clocks need not agree.
        self.clock_offset = 0.0
        # request id -> (monotonic) when a round that wrote its stream's TTL succeeded
        self._ttl_set: dict[str, float] = {}
        self._ttl_pruned = time.monotonic()

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

    def hold_claim(self) -> None:
        """Claim the requests read under this name (at start-up, before taking over the
        pending ones of a predecessor with the same name): an older process of the same
        name, if one still runs, publishes nothing more."""
        self.redis.set(self.keys.claim(self.name), self.token)

    def round(self, outputs: list[Outgoing], acks: list[str], beat: Heartbeat | None,
              read: bool = True, want: int = 0) -> Inbound:
        """Publish, acknowledge, beat, then (when `read`) read aborts and up to `want` new
        requests, in one round trip. Raises redis.ConnectionError / TimeoutError when Redis
        is unreachable: then nothing was taken, and the caller keeps its outputs and acks;
        the same when Redis is out of memory (inbound.held), but what was read is taken. Raises ClaimLost when another scheduler took this one's requests over."""
        pipe = self.redis.pipeline(transaction=False)
        handlers: list[Callable | None] = []
        now, refreshed = time.monotonic(), []     # the streams whose TTL this round sets

        def queue(command: Callable, *args, handler: Callable | None = None, **kw) -> None:
            command(*args, **kw)
            handlers.append(handler)

        if outputs or acks:
            # An ended request's entry is not needed any more: deleting it keeps the request
            # stream as long as the unfinished work (the group's lag stays exact: only entries
            # before its last-delivered id are deleted).
            keys = [self.keys.claim(self.name), self.keys.requests,
                    *(self.keys.output(request_id) for request_id, *_ in outputs)]
            args = [self.token, CONSUMER_GROUP, MSG_FIELD, len(outputs)]
            ttl_set, due = self._ttl_set, now - TTL_REFRESH_S
            for request_id, finished, _, _, data in outputs:
                if finished:
                    ttl = FINISHED_OUTPUT_TTL_S
                elif ttl_set.get(request_id, due) <= due:
                    ttl = OUTPUT_TTL_S
                    refreshed.append(request_id)
                else:
                    ttl = -OUTPUT_TTL_S
                args += [data, ttl]
            if self._publish_sha is None:
                self._publish_sha = self.redis.script_load(_PUBLISH)
            # NOTE: EVALSHA on the pipeline, not a registered Script: redis-py would check
            # that the script exists in an extra round trip before every round.
            queue(pipe.evalsha, self._publish_sha, len(keys), *keys, *args, *acks,
                  handler=lambda reply, inbound: self._published(reply, outputs, refreshed,
                                                                  now))
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
                self._ttl_set.clear()            # streams written meanwhile have none
            elif isinstance(reply, redis.OutOfMemoryError):
                inbound.held = "Redis is out of memory (maxmemory)"
            elif isinstance(reply, redis.exceptions.NoScriptError):
                self._publish_sha = None         # Redis restarted: loaded again next round
                inbound.held = "the publishing script was not loaded (Redis restarted?)"
            elif isinstance(reply, Exception):
                raise reply
            elif handler is not None:
                handler(reply, inbound)
        return inbound

    def _published(self, reply, outputs: list[Outgoing], refreshed: list[str],
                   now: float) -> None:
        self._check_claim(reply)
        ttl_set = self._ttl_set
        if reply == 2:            # Redis had lost its data: every stream is set again
            ttl_set.clear()
        for request_id in refreshed:
            ttl_set[request_id] = now
        for request_id, finished, *_ in outputs:
            if finished:
                ttl_set.pop(request_id, None)
        if now - self._ttl_pruned >= TTL_REFRESH_S:
            # requests that ended without a last output here (taken over, say): an entry
            # older than the refresh interval means the same as none
            self._ttl_pruned = now
            for request_id in [r for r, t in ttl_set.items() if t <= now - TTL_REFRESH_S]:
                del ttl_set[request_id]

    def _check_claim(self, reply, _inbound=None) -> None:
        if not reply:
            raise ClaimLost(f"scheduler {self.name}: another scheduler took over its requests "
                            "(this process was silent past the heartbeat timeout)")

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

    def release_pending(self) -> int:
        """Hand the requests this name read and has not acknowledged to a consumer that
        never beats (`{name}.released`), so that a live scheduler's reclaim (every 5 s, see
        dead_schedulers) takes them over and continues them from their streams. For a
        scheduler that runs nothing: one that stands by, or stops fenced. How many."""
        try:
            pending = self.redis.xpending_range(self.keys.requests, CONSUMER_GROUP, "-", "+",
                                                10_000, consumername=self.name)
            ids = [p["message_id"] for p in pending]
            if ids:
                self.redis.xclaim(self.keys.requests, CONSUMER_GROUP, f"{self.name}.released",
                                  0, ids)
        except redis.ResponseError:          # no group yet: nothing was read
            return 0
        except (redis.ConnectionError, redis.TimeoutError):
            return 0                         # still this name's; the next call hands them
        return len(ids)

    def take_pending(self, name: str) -> Inbound:
        """The requests `name` read and never acknowledged, now this scheduler's (a dead
        consumer is removed from the group and from the heartbeats)."""
        pending = self.redis.xpending_range(self.keys.requests, CONSUMER_GROUP, "-", "+",
                                            10_000, consumername=name)
        ids = [p["message_id"] for p in pending]
        if name != self.name:
            # First fence the other process (it may only be stalled), then take its entries:
            # whatever it published before this SET is in the streams read after it.
            self.redis.set(self.keys.claim(name), f"taken by {self.token}")
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
