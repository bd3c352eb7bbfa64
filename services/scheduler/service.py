"""The scheduler process: the engine core between Redis and the executors.

One iteration, with Redis I/O overlapped with the executor's forward pass:

    plan_k = schedule()          ─── ZMQ PUSH ──▶ executor ranks (forward k runs ...)
    (plan_k+1 = schedule_ahead() ── ZMQ PUSH ──▶ queued behind it, when only steady decodes
                                                  run: ahead.py)
    one Redis round trip:  publish outputs of step k-1, heartbeat, ack finished requests,
                           read new requests (consumer group) and aborts
    result_k  ◀── ZMQ PULL ───── executor rank 0   (a step past READ_DURING_STEP_S reads
                                                     new requests again while it waits)
    outputs_k = update(plan_k, result_k); then admit the requests / apply the aborts read above

New requests and aborts are applied only after update(): then no plan is in flight, except
one planned ahead (async scheduling, ahead.py: plan_k+1 sent right after plan_k, before
result_k), whose rows of a request aborted meanwhile are skipped when applied. With nothing
to run, the loop blocks on Redis (XREADGROUP BLOCK): it never busy-spins.

A request's stream entry is acknowledged only when the request ends, so a crashed
scheduler's unfinished requests stay pending in the consumer group for another to claim.
The Redis side is redis_link.py, the executors' sockets executor_link.py; a request's
entry id and timeline live on its SequenceGroup. A failed step or a lost executor costs no
request its stream: every request is recomputed from its prompt and streamed tokens, and a
successor scheduler continues a dead one's requests from their output streams:
recovery.py, and docs/reliability.md.
"""
from __future__ import annotations

import logging
import signal
import socket
import time
from dataclasses import dataclass, field, replace

import redis

from services.scheduler.config import SchedulerConfig
from services.scheduler.executor_link import ExecutorLink
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.outputs import Outgoing, outgoing, result_error
from services.scheduler.recovery import ExecutorLost, ExecutorTaken, Ownership, Recovery
from services.scheduler.redis_link import ClaimLost, Heartbeat, Inbound, RedisLink
from services.scheduler.scheduler import AdmissionError, Scheduler
from services.scheduler.sequence import SequenceGroup
from services.scheduler.snapshot import DashboardPublisher
from shared.control import ExecutorClient, owner_identity
from shared.heap import settle_heap
from shared.messages import (AbortRequest, GenerationRequest, RequestOutput, SeqDelta,
                             StepPlan, StepResult)
from shared.redis_keys import RedisKeys, redis_where
from shared.redis_packing import packer
from shared.wire import encode, oversized

log = logging.getLogger("pagedserve.scheduler")

# A step still running after this long reads the request queue again (seconds).
READ_DURING_STEP_S = 0.02


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
    step_timeout_s: float = 120.0         # a step still running after this has failed
    startup_timeout_s: float = 600.0      # first model load (and GGUF conversion) can be slow
    read_batch: int = 64                  # most requests taken from the queue per round trip
    # Requests are taken from the shared queue only while this replica holds fewer than
    # max_num_seqs + read_headroom unfinished ones: the rest wait in Redis, where any
    # replica (or this one's successor) can take them.
    read_headroom: int = 4
    # A request that was in the step in flight when the executor died or a step failed is
    # recomputed this many times; one more loss ends it with an error (a request that makes
    # every step fail, or a sticky device error, must not be retried forever).
    max_step_retries: int = 2
    # Plan the next step while the executor runs the current one when only steady decodes
    # run (ahead.py): "on", "off", or "auto": on when the executor's device is not the CPU
    # (a CPU forward shares its cores with this process: planning beside it slows it,
    # docs/overhead.md). An executor of several ranks always waits for each result.
    async_scheduling: str = "auto"

    def __post_init__(self) -> None:
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"async_scheduling must be auto, on or off, got "
                             f"{self.async_scheduling!r}")


def _ended(request: GenerationRequest, reason: str, error: str | None = None,
           error_code: int = 0) -> RequestOutput:
    """The final output of a request that ends before (or without) running here."""
    return RequestOutput(request.request_id,
                         [SeqDelta(i, [], finish_reason=reason)
                          for i in range(max(1, request.sampling.n))],
                         finished=True, error=error, error_code=error_code)


class SchedulerService:
    def __init__(self, config: SchedulerServiceConfig) -> None:
        self.config = config
        self.link = RedisLink(redis.Redis.from_url(config.redis_url, socket_timeout=10,
                                                   socket_connect_timeout=5,
                                                   command_packer=packer()),
                              RedisKeys(config.redis_prefix), config.name)
        self.executor = ExecutorClient(config.executor)
        self.executors = ExecutorLink()
        self.sched: Scheduler | None = None
        self.metrics: SchedulerMetrics | None = None
        # Unfinished admitted requests (their groups outlive a core rebuilt after a crash).
        self.requests: dict[str, SequenceGroup] = {}
        self.degraded: str | None = None                     # why /health should say degraded
        self.recent_aborts: dict[str, float] = {}   # request_id -> when (aborts may precede reads)
        self.pending_outputs: list[Outgoing] = []       # encoded, for the next round
        self.to_ack: list[str] = []
        self.inbox: list[tuple[str, GenerationRequest]] = []     # (entry id, request)
        self.abort_inbox: list[AbortRequest] = []
        self.stopping = False
        self._last_beat = 0.0
        self._last_metrics = 0.0
        self._next_reclaim = time.monotonic() + 5.0
        self.plan: StepPlan | None = None        # the plan in flight
        self.ahead: StepPlan | None = None       # the one after it, planned and sent ahead
        self.plans_ahead = False                 # async scheduling with this executor
        self.owner = Ownership(self.executor, config.name)
        self.recovery = Recovery(self)
        self.dashboard = DashboardPublisher(self.link.redis, self.link.keys, config.name)

    # ------------------------------------------------------------ set-up
    def connect(self, timeout_s: float | None = None) -> None:
        """Attach to the executor (waiting up to `timeout_s` for it), then build a fresh
        engine core, or start the current one over on the executor's fresh pool."""
        info = self.executor.wait_ready(timeout_s or self.config.startup_timeout_s)
        self.owner.take(info.instance_id)
        self.pool = (int(info.num_gpu_blocks), int(info.num_cpu_blocks))
        self.dashboard.tp = max(1, info.tensor_parallel_size)
        mode = self.config.async_scheduling
        self.plans_ahead = self.dashboard.tp == 1 and (
            mode == "on" or mode == "auto" and not info.device.startswith("cpu"))
        if self.sched is None:
            core = replace(self.config.core, block_size=info.block_size,
                           max_model_len=min(self.config.core.max_model_len,
                                         info.max_model_len))
            self.sched = Scheduler(core, *self.pool)
        elif (info.block_size != self.sched.block_size
              or info.max_model_len < self.sched.config.max_model_len):
            raise RuntimeError(f"the executor came back with another shape (block size "
                               f"{info.block_size}, max_model_len {info.max_model_len}); "
                               f"restart the scheduler")
        else:
            self.sched.recompute_all(*self.pool)
        if self.metrics is None:
            self.metrics = SchedulerMetrics(info.model, lambda: self.sched.stats())
            if self.config.metrics_port:
                from prometheus_client import start_http_server
                start_http_server(self.config.metrics_port, addr=self.config.metrics_host,
                                  registry=self.metrics.registry)
        self.executors.connect(info.plan_endpoints, info.result_endpoint,
                               owner_identity(self.config.name, self.owner.fence))
        log.info("scheduler %s: %s, %d GPU blocks of %d tokens, %d CPU blocks, async "
                 "scheduling %s", self.config.name, info.model, info.num_gpu_blocks,
                 info.block_size, info.num_cpu_blocks, "on" if self.plans_ahead else "off")
        if mode == "on" and not self.plans_ahead:
            log.warning("--async-scheduling on: not with an executor of %d ranks (only rank 0 "
                        "sees the sampled tokens); every step waits for its result",
                        self.dashboard.tp)

    # ------------------------------------------------------------ main loop
    def _wait_for_redis(self) -> bool:
        """Take Redis's clock, waiting while Redis does not answer (it may start beside this
        process, or restart): a warning every 10 s. False when stopped meanwhile."""
        where = redis_where(self.config.redis_url)
        warned = None
        while not self.stopping:
            try:
                self.link.sync_clock()
                return True
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if warned is None or time.monotonic() - warned >= 10:
                    log.warning("Redis at %s does not answer (%s): waiting for it", where, exc)
                    warned = time.monotonic()
                time.sleep(0.5)
        return False

    def serve(self) -> int:
        """Run until stopped; the exit status (3: another scheduler fenced this one)."""
        if not self._wait_for_redis():
            return 0
        while True:
            try:
                self.connect()
                break
            except ExecutorTaken as exc:       # a standby: it takes over when the owner dies
                log.warning("%s", exc)
                self.degraded = str(exc)
                self.beat(force=True)
                # What an earlier process of this name read (one fenced, then restarted)
                # goes to the owner: this one beats, so it would never be reclaimed.
                if self.link.release_pending():
                    log.warning("standing by: handed this name's unfinished requests over")
                time.sleep(1.0)
        self.degraded = None
        # NOTE: the hot loop allocates many short-lived objects; long-lived start-up state
        # is frozen out of the collector and young collections run less often.
        settle_heap()
        self.link.ensure_group()
        self.link.hold_claim()
        self.recovery.reclaim_pending(include_self=True)
        self.beat(force=True)
        while not self.stopping:
            try:
                try:
                    self._iterate()
                except ExecutorLost as exc:
                    plan, self.plan, self.ahead = self.plan, None, None
                    self.recovery.recover(plan, str(exc), executor_alive=False)
            except (ExecutorTaken, ClaimLost) as exc:
                # Another scheduler owns the executor, or took over this one's requests:
                # publish nothing more. What this one still holds is pending in Redis;
                # another takes it over and continues each request from its stream.
                log.critical("fenced, stopping without publishing: %s", exc)
                if isinstance(exc, ExecutorTaken):
                    # The owner takes them over within its next reclaim (5 s), not only
                    # once this heartbeat is 10 s old. (ClaimLost: already taken.)
                    self.link.release_pending()
                return 3
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("request group vanished (Redis restarted?); recreating it")
                self.link.ensure_group()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Keep running what we have; outputs wait in memory until Redis is back.
                log.warning("Redis unreachable (%s); retrying", exc)
                time.sleep(0.5)
        try:
            self._redis_round(block_ms=0)
        except (redis.RedisError, ClaimLost):
            pass
        return 0

    def _iterate(self) -> None:
        self.dashboard.tick(self.sched)          # nothing unless a dashboard page is open
        if time.monotonic() > self._next_reclaim:
            self._next_reclaim = time.monotonic() + 5.0
            self.recovery.reclaim_pending()
        if self.ahead is not None:               # sent while the plan before it ran
            plan, self.ahead = self.ahead, None
        else:
            plan = self._schedule_and_send()
            if plan is None:
                return
        self.plan = plan
        if self.plans_ahead:
            self.ahead = self._send_ahead()
        self._redis_round(block_ms=0)
        result = self._recv_result(plan)
        error = result_error(plan, result)
        if error is not None:
            # The KV state of what the step ran is unknown: start over by recompute, and
            # end only the requests of this step that have used up their retries. (A plan
            # refused as fenced: Ownership.check raises when another scheduler owns it.)
            # A plan sent ahead of it is forgotten with the rest of the core's state.
            self.plan = self.ahead = None
            self.recovery.recover(plan, error, executor_alive=self.owner.check())
            return
        self.plan = None
        self.publish(self.sched.update(plan, result).encoded())
        self._apply_inbox()

    def _schedule_and_send(self) -> StepPlan | None:
        """Plan the next step once the one before is applied, and send it. None when there
        is nothing to run or the plan could not be sent (then this iteration is over)."""
        plan = self.sched.schedule()
        if self.sched.refused:                   # a grammar that failed to compile
            self.emit(self.sched.refused)
            self.sched.refused = []
        if plan is None:
            # Idle: no plan renews the lease, and a restarted executor goes unnoticed.
            if time.monotonic() - self.owner.last_renew >= 1.0 and not self.owner.check():
                raise ExecutorLost(f"executor {self.config.executor} stopped answering")
            self._redis_round(block_ms=500)
            self._apply_inbox()
            return None
        self._note_scheduled(plan)
        plan.fence = self.owner.fence
        data = encode(plan)
        too_big = oversized(data, f"the plan of step {plan.step_id}")
        if too_big is not None:
            # Never sent (it would cut the executor's connection, see MAX_MESSAGE_BYTES):
            # the executors' state is untouched, so the requests of this step fail, the
            # others run on. Retrying would build the same plan.
            log.error("%s; failing its requests", too_big)
            self.publish(self.sched.fail_unsent(plan, too_big).encoded())
            self._apply_inbox()
            return None
        self.executors.send(data)
        return plan

    def _send_ahead(self) -> StepPlan | None:
        """Plan the step after the one in flight and send it, so that the executor starts it
        as soon as it is done (ahead.py); None when the next step must wait for the result.
        (An ahead plan is one decode row per seq of the plan in flight and the ids to drop:
        under 30 bytes a seq, against MAX_MESSAGE_BYTES' 64 MiB.)"""
        plan = self.sched.schedule_ahead()
        if plan is not None:
            plan.fence = self.owner.fence
            self.executors.send(encode(plan))
        return plan

    def stop(self) -> None:
        self.stopping = True

    def flush_outputs(self) -> None:
        if self.pending_outputs or self.to_ack:
            self._redis_round(block_ms=0, read=False)

    def _recv_result(self, plan: StepPlan) -> StepResult:
        """The result answering `plan`. A result of another step is stale and dropped, except
        a failure with no step id (the executor could not read the plan in flight)."""
        deadline_check = time.monotonic() + self.config.executor_timeout_s
        deadline = time.monotonic() + self.config.step_timeout_s
        read_at = time.monotonic() + READ_DURING_STEP_S
        while True:
            result = self.executors.recv(int(READ_DURING_STEP_S * 1000))
            if result is not None:
                self.owner.heard()
                if result.step_id == plan.step_id:
                    return result
                if result.error is not None and result.step_id < 0:
                    return StepResult(plan.step_id, error=result.error)
                log.warning("discarding result of step %d (waiting for %d)%s", result.step_id,
                            plan.step_id, f": {result.error}" if result.error else "")
                continue
            # A long forward (a big prefill, a loaded host) is not a dead scheduler: gateways
            # end the streams of a scheduler whose heartbeat stops (scheduler_gone_s). Requests
            # that arrived since the round at the step's start are read now, so that they join
            # the next step rather than the one after it (a client's time to first token).
            try:
                if time.monotonic() >= read_at:
                    read_at = time.monotonic() + READ_DURING_STEP_S
                    self._redis_round(block_ms=0)
                else:
                    self.beat()
            except redis.RedisError:
                pass            # the next Redis round after this step meets it
            if time.monotonic() > deadline:
                raise ExecutorLost(f"step {plan.step_id} ran past the step deadline "
                                   f"({self.config.step_timeout_s:g} s)")
            if time.monotonic() > deadline_check:
                # A long forward is fine as long as the executor still answers health checks.
                if not self.owner.check():
                    raise ExecutorLost(f"executor {self.config.executor} stopped answering")
                deadline_check = time.monotonic() + self.config.executor_timeout_s

    def _note_scheduled(self, plan: StepPlan) -> None:
        now = time.time()
        for seq in plan.new_seqs:
            group = self.requests.get(seq.request_id)
            if group is not None and not group.scheduled_at:
                group.scheduled_at = now
                self.metrics.queue.observe(max(0.0, now - group.arrival_time))

    # ------------------------------------------------------------ Redis
    def _redis_round(self, block_ms: int, read: bool = True) -> None:
        """Publish, acknowledge, heartbeat and read new work: one round trip when busy.

        If Redis is unreachable, nothing is lost: outputs and acks stay queued in memory
        and go out in the first round that succeeds.
        """
        if self.pending_outputs and self.owner.must_check():
            self.owner.check()                   # raises ExecutorTaken when fenced
        outputs = list(self.pending_outputs)
        acks = list(self.to_ack)
        want = self._read_count() if read else 0
        try:
            ended = any(finished for _, finished, *_ in outputs)
            inbound = self.link.round(outputs, acks, self._heartbeat(ended), read, want)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("Redis unreachable (%s); %d outputs held", exc, len(outputs))
            time.sleep(max(block_ms, 100) / 1000)
            return
        if inbound.held:
            # Held until Redis takes them; gateways answer 503 meanwhile when it is full.
            log.warning("%s; %d outputs held", inbound.held, len(outputs))
            time.sleep(0.2)
        else:
            del self.pending_outputs[:len(outputs)]
            del self.to_ack[:len(acks)]
        self.take(inbound)
        if read and want and not inbound.requests and block_ms and not self.sched.has_unfinished():
            self.take(self.link.wait_for_requests(want, block_ms))

    def take(self, inbound: Inbound) -> None:
        self.abort_inbox += inbound.aborts
        self.inbox += inbound.requests
        self.to_ack += inbound.malformed
        for request_id, why in inbound.refused:
            self.emit([RequestOutput(request_id, [], finished=True, error=why,
                                     error_code=400)])

    def _read_count(self) -> int:
        held = len(self.requests) + len(self.inbox)
        room = self.config.core.max_num_seqs + self.config.read_headroom - held
        return max(0, min(self.config.read_batch, room))

    def _heartbeat(self, force: bool = False) -> Heartbeat | None:
        """Heartbeat (1 s) and metrics snapshot (0.2 s, or at once when a request ended)."""
        now = time.time()
        metrics = None
        if self.metrics is not None and (force or now - self._last_metrics >= 0.2):
            self._last_metrics = now
            metrics = self.metrics.exposition()
        if not (force or metrics is not None or now - self._last_beat >= 1.0):
            return None
        self._last_beat = now
        return Heartbeat(self.link.now(), self.degraded, metrics)

    def beat(self, force: bool = False) -> None:
        beat = self._heartbeat(force)
        if beat is not None:
            self.link.beat(beat)

    def _apply_inbox(self) -> None:
        now = time.time()
        for ab in self.abort_inbox:
            if ab.index >= 0:           # one sequence (its choice ended at a stop string)
                out = self.sched.abort_seq(ab.request_id, ab.index, ab.reason)
                if out is not None:
                    self.emit([out])
                continue
            self.recent_aborts[ab.request_id] = now
            out = self.sched.abort_request(ab.request_id, ab.reason)
            if out is not None:
                self.emit([out])
        self.abort_inbox = []
        for eid, req in self.inbox:
            if req.request_id in self.recent_aborts:
                self.emit([_ended(req, "abort")])
                self.to_ack.append(eid)
                continue
            try:
                self.sched.add_request(req)
            except AdmissionError as exc:
                self.emit([RequestOutput(req.request_id, [], finished=True, error=str(exc),
                                         error_code=400)])
                self.to_ack.append(eid)
                continue
            group = self.sched.groups[req.request_id]
            self.recovery.resume_group(group)
            if not group.seqs:      # taken over, every choice had ended: only the end
                self.emit([self.sched.abort_request(req.request_id, "stop")])
                self.to_ack.append(eid)
                continue
            group.entry_id = eid
            group.arrival_time = req.arrival_time or now
            self.requests[req.request_id] = group
        self.inbox = []
        if len(self.recent_aborts) > 10_000:
            cutoff = now - 600
            self.recent_aborts = {k: v for k, v in self.recent_aborts.items() if v > cutoff}

    def emit(self, outputs: list[RequestOutput]) -> None:
        """Queue whole outputs for the next round (see publish)."""
        self.publish([outgoing(out) for out in outputs])

    def publish(self, outputs: list[Outgoing]) -> None:
        """Queue encoded outputs for the next round; observe the request timeline; an ended
        request's stream entry is acknowledged in the same round as its last output."""
        self.pending_outputs += outputs
        now = time.time()
        requests = self.requests
        for request_id, finished, failed, new, _ in outputs:
            group = requests.pop(request_id, None) if finished else requests.get(request_id)
            if group is None:
                continue
            if finished:
                self.to_ack.append(group.entry_id)
                self.recovery.forget(request_id)
                if not failed:
                    self.metrics.e2e.observe(max(0.0, now - group.arrival_time))
            if not new:
                continue
            if not group.first_token_at:
                group.first_token_at = now
                self.metrics.ttft.observe(max(0.0, now - group.arrival_time))
            elif group.last_token_at:
                gap = (now - group.last_token_at) / new
                for _ in range(new):
                    self.metrics.itl.observe(gap)
            group.last_token_at = now


def run(config: SchedulerServiceConfig) -> int:
    service = SchedulerService(config)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: service.stop())
    return service.serve()
