"""The scheduler process: the engine core between Redis and the executors.

One iteration, with Redis I/O overlapped with the executor's forward pass:

    plan_k = schedule()          ─── ZMQ PUSH ──▶ executor ranks (forward k runs ...)
    one Redis round trip:  publish outputs of step k-1, heartbeat, ack finished requests,
                           read new requests (consumer group) and aborts
    result_k  ◀── ZMQ PULL ───── executor rank 0
    outputs_k = update(plan_k, result_k); then admit the requests / apply the aborts read above

New requests and aborts are applied only between update() and the next schedule(), so the
core never sees a change while a plan is in flight. With nothing to run, the loop blocks on
Redis (XREADGROUP BLOCK): it never busy-spins.

A request's stream entry is acknowledged only when the request ends, so a crashed
scheduler's unfinished requests stay pending in the consumer group for another to claim.
"""
from __future__ import annotations

import gc
import logging
import signal
import socket
import time
from dataclasses import dataclass, field, replace

import redis
import zmq

from services.scheduler.config import SchedulerConfig
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.scheduler import AdmissionError, Scheduler
from shared.control import ExecutorClient
from shared.messages import (AbortRequest, GenerationRequest, RequestOutput, SeqDelta,
                             StepPlan, StepResult)
from shared.redis_keys import (CONSUMER_GROUP, FINISHED_OUTPUT_TTL_S, MSG_FIELD, OUTPUT_TTL_S,
                               RedisKeys)
from shared.wire import WireError, decode, encode

log = logging.getLogger("pagedserve.scheduler")

# Young-generation GC threshold of the running service (see serve()); benchmarks reuse it.
GC_THRESHOLD = (20_000, 50, 100)


@dataclass(slots=True)
class SchedulerServiceConfig:
    core: SchedulerConfig = field(default_factory=SchedulerConfig)
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "pagedserve"
    executor: str = "127.0.0.1:50051"     # gRPC address of executor rank 0
    name: str = field(default_factory=lambda: f"{socket.gethostname()}-sched")
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0                 # 0: no HTTP endpoint (the gateway serves /metrics)
    executor_timeout_s: float = 2.0       # a silent executor is declared dead after this
    startup_timeout_s: float = 600.0      # first model load (and GGUF conversion) can be slow
    read_batch: int = 64                  # most requests taken from the queue per round trip
    # Requests are taken from the shared queue only while this replica holds fewer than
    # max_num_seqs + read_headroom unfinished ones: the rest wait in Redis, where any
    # replica (or this one's successor) can take them.
    read_headroom: int = 4


class ExecutorLost(RuntimeError):
    pass


@dataclass(slots=True)
class _Timing:
    arrival: float
    entry_id: str
    scheduled: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0


class SchedulerService:
    def __init__(self, config: SchedulerServiceConfig) -> None:
        self.config = config
        self.keys = RedisKeys(config.redis_prefix)
        self.redis = redis.Redis.from_url(config.redis_url, socket_timeout=10,
                                          socket_connect_timeout=5)
        self.executor = ExecutorClient(config.executor)
        self.zmq = zmq.Context.instance()
        self.sched: Scheduler | None = None
        self.metrics: SchedulerMetrics | None = None
        self.timing: dict[str, _Timing] = {}
        self.admitted: dict[str, GenerationRequest] = {}   # unfinished, by id
        self.degraded: str | None = None                     # why /health should say degraded
        self.recent_aborts: dict[str, float] = {}   # request_id -> when (aborts may precede reads)
        self.abort_cursor = "0"
        self.pending_outputs: list[RequestOutput] = []
        self.to_ack: list[str] = []
        self.inbox: list[GenerationRequest] = []
        self.abort_inbox: list[AbortRequest] = []
        self.step_id = 0
        self._stop = False
        self._last_beat = 0.0
        self._last_metrics = 0.0
        self._next_reclaim = time.monotonic() + 5.0

    # ------------------------------------------------------------ set-up
    def connect(self) -> None:
        """Attach to the executor (waiting for it), then build a fresh engine core."""
        info = self.executor.wait_ready(self.config.startup_timeout_s)
        self.executor.reset()          # forget sequences a previous scheduler left behind
        core = replace(self.config.core, block_size=info.block_size,
                       max_model_len=min(self.config.core.max_model_len, info.max_model_len))
        self.sched = Scheduler(core, int(info.num_gpu_blocks), int(info.num_cpu_blocks))
        if self.metrics is None:
            self.metrics = SchedulerMetrics(info.model, lambda: self.sched.stats())
            if self.config.metrics_port:
                from prometheus_client import start_http_server
                start_http_server(self.config.metrics_port, addr=self.config.metrics_host,
                                  registry=self.metrics.registry)
        for sock in getattr(self, "plan_socks", []) + [getattr(self, "result_sock", None)]:
            if sock is not None:
                sock.close()
        self.plan_socks = []
        for ep in info.plan_endpoints:
            s = self.zmq.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            self.plan_socks.append(s)
        self.result_sock = self.zmq.socket(zmq.PULL)
        self.result_sock.setsockopt(zmq.LINGER, 0)
        self.result_sock.connect(info.result_endpoint)
        log.info("scheduler %s: %s, %d GPU blocks of %d tokens, %d CPU blocks", self.config.name,
                 info.model, info.num_gpu_blocks, info.block_size, info.num_cpu_blocks)

    def _ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(self.keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # ------------------------------------------------------------ main loop
    def serve(self) -> None:
        self.connect()
        # NOTE: the hot loop allocates many short-lived objects; long-lived start-up state
        # is frozen out of the collector and young collections run less often.
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLD)
        self._ensure_group()
        self._reclaim_pending(include_self=True)
        self._beat(force=True)
        while not self._stop:
            try:
                self._iterate()
            except ExecutorLost as exc:
                self._recover(str(exc))
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("request group vanished (Redis restarted?); recreating it")
                self._ensure_group()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Keep running what we have; outputs wait in memory until Redis is back.
                log.warning("Redis unreachable (%s); retrying", exc)
                time.sleep(0.5)
        try:
            self._redis_round(block_ms=0)
        except redis.RedisError:
            pass

    def _iterate(self) -> None:
        if time.monotonic() > self._next_reclaim:
            self._next_reclaim = time.monotonic() + 5.0
            self._reclaim_pending()
        plan = self.sched.schedule()
        if plan is None:
            self._redis_round(block_ms=500)
            self._apply_inbox()
            return
        self._note_scheduled(plan)
        data = encode(plan)
        for sock in self.plan_socks:
            sock.send(data, copy=False)
        self._redis_round(block_ms=0)
        result = self._recv_result(plan.step_id)
        self.pending_outputs.extend(self.sched.update(plan, result))
        self._apply_inbox()

    def stop(self) -> None:
        self._stop = True

    # ------------------------------------------------------------ failures
    def _recover(self, reason: str) -> None:
        """The executor died: end what it was running with an error, keep the rest queued.

        Requests that already streamed tokens cannot be resumed invisibly (their KV cache
        died with the executor), so they end with finish_reason "error". Requests that had
        not produced a token are re-admitted into a fresh core once an executor is back.
        """
        log.error("executor lost (%s): failing started requests, waiting for it to return", reason)
        self.degraded = f"executor lost: {reason}"
        self._beat(force=True)                                       # /health: degraded
        requeue = []
        for rid, req in list(self.admitted.items()):
            t = self.timing.get(rid)
            if t is not None and t.first_token:
                n = max(1, req.sampling.n)
                self.pending_outputs.append(RequestOutput(
                    rid, [SeqDelta(i, [], finish_reason="error") for i in range(n)], finished=True,
                    error=f"the executor failed while running this request ({reason}); retry it",
                    error_code=503))
            else:
                requeue.append(req)
        self.admitted.clear()
        self._flush_outputs()
        while not self._stop:
            try:
                self.connect()
                break
            except Exception as exc:  # timeouts and gRPC errors while it restarts
                log.warning("executor not back yet: %s", exc)
                self._beat()
                time.sleep(0.5)
        self.inbox = requeue + self.inbox
        self._apply_inbox()
        self.degraded = None
        self._beat(force=True)
        log.info("executor is back; %d queued requests re-admitted", len(requeue))

    def _flush_outputs(self) -> None:
        if self.pending_outputs or self.to_ack:
            self._redis_round(block_ms=0, read=False)

    def _reclaim_pending(self, include_self: bool = False) -> None:
        """Take over requests read by this name before a restart, or by a dead scheduler.

        A request that had already streamed output ends with an explicit error (its KV
        state is gone); one that never started is simply run here.
        """
        now = time.time()
        beats = {k.decode(): float(v) for k, v in self.redis.hgetall(self.keys.schedulers).items()}
        dead = [name for name, t in beats.items() if name != self.config.name and now - t > 10]
        try:
            consumers = [c["name"] for c in self.redis.xinfo_consumers(self.keys.requests,
                                                                       CONSUMER_GROUP)]
        except redis.ResponseError:
            consumers = []
        consumers = [c.decode() if isinstance(c, bytes) else c for c in consumers]
        dead += [c for c in consumers if c not in beats and c != self.config.name]
        for name in ([self.config.name] if include_self else []) + dead:
            pending = self.redis.xpending_range(self.keys.requests, CONSUMER_GROUP, "-", "+",
                                                10_000, consumername=name)
            ids = [p["message_id"] for p in pending]
            if name != self.config.name:
                if ids:
                    self.redis.xclaim(self.keys.requests, CONSUMER_GROUP, self.config.name, 0, ids)
                self.redis.xgroup_delconsumer(self.keys.requests, CONSUMER_GROUP, name)
                self.redis.hdel(self.keys.schedulers, name)
            if not ids:
                continue
            entries = self.redis.xrange(self.keys.requests, ids[0], ids[-1])
            wanted = {i if isinstance(i, bytes) else i.encode() for i in ids}
            taken = [(eid, f) for eid, f in entries
                     if (eid if isinstance(eid, bytes) else eid.encode()) in wanted]
            started = self._take_requests([(self.keys.requests, taken)], check_started=True)
            log.warning("reclaimed %d pending requests of %s (%d had started and were failed)",
                        len(taken), name, started)
        self._flush_outputs()

    def _recv_result(self, step_id: int) -> StepResult:
        deadline_check = time.monotonic() + self.config.executor_timeout_s
        while True:
            if self.result_sock.poll(100):
                result = decode(self.result_sock.recv(), StepResult)
                if result.step_id != step_id:
                    log.warning("discarding result of step %d (waiting for %d)",
                                result.step_id, step_id)
                    continue
                if result.error:
                    raise ExecutorLost(result.error)
                return result
            if time.monotonic() > deadline_check:
                # A long forward is fine as long as the executor still answers health checks.
                if not self.executor.is_alive(timeout=1.0):
                    raise ExecutorLost(f"executor {self.config.executor} stopped answering")
                deadline_check = time.monotonic() + self.config.executor_timeout_s

    def _note_scheduled(self, plan: StepPlan) -> None:
        now = time.time()
        for seq in plan.new_seqs:
            t = self.timing.get(seq.request_id)
            if t is not None and not t.scheduled:
                t.scheduled = now
                self.metrics.queue.observe(max(0.0, now - t.arrival))

    # ------------------------------------------------------------ Redis
    def _redis_round(self, block_ms: int, read: bool = True) -> None:
        """Publish, acknowledge, heartbeat and read new work: one round trip when busy.

        If Redis is unreachable, nothing is lost: outputs and acks stay queued in memory
        and go out in the first round that succeeds.
        """
        outputs = list(self.pending_outputs)
        acks = list(self.to_ack)
        pipe = self.redis.pipeline(transaction=False)
        for out in outputs:
            key = self.keys.output(out.request_id)
            pipe.xadd(key, {MSG_FIELD: encode(out)})
            pipe.expire(key, FINISHED_OUTPUT_TTL_S if out.finished else OUTPUT_TTL_S)
            t = self.timing.get(out.request_id)
            if out.finished and t is not None:
                acks.append(t.entry_id)
        if acks:
            # A finished request's entry is not needed any more: deleting it keeps the
            # request stream as long as the unfinished work (the group's lag stays exact:
            # only entries before its last-delivered id are deleted).
            pipe.xack(self.keys.requests, CONSUMER_GROUP, *acks)
            pipe.xdel(self.keys.requests, *acks)
        self._beat(pipe=pipe, force=any(o.finished for o in outputs))
        want = self._read_count()
        if read:
            pipe.xread({self.keys.aborts: self.abort_cursor}, count=1000)
            if want:
                pipe.xreadgroup(CONSUMER_GROUP, self.config.name, {self.keys.requests: ">"},
                                count=want)
        try:
            replies = pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("Redis unreachable (%s); %d outputs held", exc, len(outputs))
            time.sleep(max(block_ms, 100) / 1000)
            return
        del self.pending_outputs[:len(outputs)]
        self.to_ack = []
        now = time.time()
        for out in outputs:
            self._observe(out, now)
            if out.finished:
                self.admitted.pop(out.request_id, None)
                self.timing.pop(out.request_id, None)
        if not read:
            return
        if not want:
            self._take_aborts(replies[-1])
            return
        self._take_aborts(replies[-2])
        got = self._take_requests(replies[-1])
        if not got and block_ms and not self.sched.has_unfinished():
            reply = self.redis.xreadgroup(CONSUMER_GROUP, self.config.name,
                                          {self.keys.requests: ">"}, count=want, block=block_ms)
            self._take_requests(reply)

    def _read_count(self) -> int:
        held = len(self.admitted) + len(self.inbox)
        room = self.config.core.max_num_seqs + self.config.read_headroom - held
        return max(0, min(self.config.read_batch, room))

    def _beat(self, pipe=None, force: bool = False) -> None:
        """Heartbeat (1 s) and metrics snapshot (0.2 s, or at once when a request ended)."""
        now = time.time()
        target = pipe if pipe is not None else self.redis
        if force or now - self._last_beat >= 1.0:
            self._last_beat = now
            target.hset(self.keys.schedulers, self.config.name, f"{now:.3f}")
            if self.degraded:
                target.hset(self.keys.degraded, self.config.name, self.degraded)
            else:
                target.hdel(self.keys.degraded, self.config.name)
        if self.metrics is not None and (force or now - self._last_metrics >= 0.2):
            self._last_metrics = now
            target.set(self.keys.metrics(self.config.name), self.metrics.exposition(), ex=15)

    def _take_aborts(self, reply) -> None:
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self.abort_cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                try:
                    self.abort_inbox.append(decode(fields[MSG_FIELD], AbortRequest))
                except (WireError, KeyError):
                    log.warning("ignoring malformed abort %s", self.abort_cursor)

    def _take_requests(self, reply, check_started: bool = False) -> int:
        """Queue newly read request entries; returns how many (or, when reclaiming, how many
        had already started elsewhere and were failed)."""
        got = failed = 0
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                got += 1
                eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                try:
                    req = decode(fields[MSG_FIELD], GenerationRequest)
                except (WireError, KeyError) as exc:
                    log.warning("dropping malformed request entry %s: %s", eid, exc)
                    self.to_ack.append(eid)
                    continue
                self.timing[req.request_id] = _Timing(arrival=req.arrival_time or time.time(),
                                                      entry_id=eid)
                if check_started and self._has_output(req.request_id):
                    failed += 1
                    n = max(1, req.sampling.n)
                    self.pending_outputs.append(RequestOutput(
                        req.request_id, [SeqDelta(i, [], finish_reason="error") for i in range(n)],
                        finished=True, error="the scheduler running this request stopped; retry it",
                        error_code=503))
                    continue
                self.inbox.append(req)
        return failed if check_started else got

    def _has_output(self, request_id: str) -> bool:
        """Did any scheduler publish output for this request? (The gateway's header entry
        in the same stream does not count.)"""
        entries = self.redis.xrange(self.keys.output(request_id), count=4)
        return any(MSG_FIELD in fields for _eid, fields in entries)

    def _apply_inbox(self) -> None:
        now = time.time()
        for ab in self.abort_inbox:
            if ab.index >= 0:           # one sequence (its choice ended at a stop string)
                out = self.sched.abort_seq(ab.request_id, ab.index, ab.reason)
                if out is not None:
                    self.pending_outputs.append(out)
                continue
            self.recent_aborts[ab.request_id] = now
            out = self.sched.abort_request(ab.request_id, ab.reason)
            if out is not None:
                out.finished = True
                self.pending_outputs.append(out)
        self.abort_inbox = []
        for req in self.inbox:
            if req.request_id in self.recent_aborts:
                self.pending_outputs.append(RequestOutput(
                    req.request_id, [SeqDelta(i, [], finish_reason="abort")
                                     for i in range(max(1, req.sampling.n))], finished=True))
                continue
            try:
                self.sched.add_request(req)
                self.admitted[req.request_id] = req
            except AdmissionError as exc:
                self.pending_outputs.append(RequestOutput(
                    req.request_id, [], finished=True, error=str(exc), error_code=400))
        self.inbox = []
        if len(self.recent_aborts) > 10_000:
            cutoff = now - 600
            self.recent_aborts = {k: v for k, v in self.recent_aborts.items() if v > cutoff}

    def _observe(self, out: RequestOutput, now: float) -> None:
        t = self.timing.get(out.request_id)
        if t is None:
            return
        new = sum(len(s.token_ids) for s in out.seqs)
        if new:
            if not t.first_token:
                t.first_token = now
                self.metrics.ttft.observe(max(0.0, now - t.arrival))
            elif t.last_token:
                gap = (now - t.last_token) / new
                for _ in range(new):
                    self.metrics.itl.observe(gap)
            t.last_token = now
        if out.finished and out.error is None:
            self.metrics.e2e.observe(max(0.0, now - t.arrival))


def run(config: SchedulerServiceConfig) -> None:
    service = SchedulerService(config)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: service.stop())
    service.serve()
