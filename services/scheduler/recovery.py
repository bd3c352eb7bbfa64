"""Owning the executor, and keeping every request when a step, the executor or a scheduler
is lost (docs/reliability.md).

    Ownership   this scheduler's hold on its executor: the fencing token its Reset returned
                (every StepPlan carries it; the executor refuses a plan with another), the
                executor's instance id, when the executor was last heard from
    Recovery    a failed step or a lost executor: every request is recomputed from its
                prompt and the tokens it already streamed, on the executor once it answers
                again; the requests of the step in flight count one loss each, and one lost
                more than max_step_retries times ends with an error.
                A dead scheduler's pending requests are taken over and continue from what
                their output streams hold.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

import grpc
import redis

from services.scheduler.redis_link import Heartbeat
from services.scheduler.sequence import SequenceGroup
from shared.control import OWNER_LEASE_S, ExecutorClient
from shared.messages import RequestOutput, StepPlan

if TYPE_CHECKING:
    from services.scheduler.service import SchedulerService

log = logging.getLogger("pagedserve.scheduler")


class ExecutorLost(RuntimeError):
    pass


class ExecutorTaken(RuntimeError):
    """Another scheduler owns the executor (its lease is live): this one stands by."""


class Ownership:
    """The fence and lease of the executor this scheduler owns."""

    __slots__ = ("executor", "name", "fence", "instance", "last_renew", "last_contact")

    def __init__(self, executor: ExecutorClient, name: str) -> None:
        self.executor = executor
        self.name = name
        self.fence = 0            # this owner's token (the executor's Reset); 0: none yet
        self.instance = ""        # the executor's instance id (Describe)
        # Monotonic s of the last result or health answer of the executor: a scheduler
        # that was stopped (SIGSTOP, a long GC) past the executor's owner lease checks it
        # still owns it before it publishes anything (another may have taken over).
        self.last_renew = self.last_contact = 0.0

    def take(self, instance_id: str) -> None:
        """Take the executor over (its sequences from a previous owner are dropped). Raises
        ExecutorTaken, touching nothing, when another scheduler's lease on it is live."""
        reply = self.executor.reset(owner=self.name)
        if not reply.fence:
            raise ExecutorTaken(f"executor {self.executor.address} is owned by the live "
                                f"scheduler {reply.holder!r}; standing by")
        self.fence, self.instance = reply.fence, instance_id

    def heard(self) -> None:
        self.last_contact = time.monotonic()

    def must_check(self) -> bool:
        """Whether to confirm the lease before publishing: nothing heard for half of it."""
        return bool(self.instance) and time.monotonic() - self.last_contact > OWNER_LEASE_S / 2

    def check(self) -> bool:
        """Health of the executor, renewing the lease. Raises ExecutorTaken when another
        scheduler has taken it over (its token is not ours any more)."""
        try:
            reply = self.executor.health(owner=self.name)
        except grpc.RpcError:
            return False
        if reply.instance_id != self.instance:
            return False                # another executor there: this one is lost
        if reply.fence != self.fence:
            raise ExecutorTaken(f"fenced: the executor's token is {reply.fence}, not "
                                f"{self.fence}: another scheduler took it over")
        self.last_renew = self.last_contact = time.monotonic()
        return reply.ok


@contextmanager
def beating(svc: SchedulerService):
    """Heartbeats from a thread while the loop waits in a reconnect: its gRPC calls are
    bounded, but together (channel ready, Describe, Reset) take up to 9 s when the executor
    answers slowly, longer than gateways wait before they call the scheduler gone."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(1.0):
            try:
                svc.link.beat(Heartbeat(svc.link.now(), svc.degraded))
            except redis.RedisError:
                pass             # the loop's own next round meets it

    thread = threading.Thread(target=run, name="reconnect-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class Recovery:
    """What the service does when a step or the executor is lost, and when it takes over the
    requests of a scheduler that died."""

    def __init__(self, service: SchedulerService) -> None:
        self.service = service
        self.losses: dict[str, int] = {}         # request id -> steps of it lost or failed
        # request id -> (tokens already published per sample index, the indices that
        # ended): what a predecessor streamed of a request this scheduler takes over
        self.resume: dict[str, tuple[dict[int, list[int]], set[int]]] = {}

    def recover(self, plan: StepPlan | None, reason: str, executor_alive: bool) -> None:
        """Keep every request, and once an executor answers again (the same one after a
        failed step, after a Reset) run them all again by recompute, so their streams simply
        continue. `plan` is the plan in flight: its requests count one loss each."""
        svc = self.service
        log.error("step failed (%s); executor %s: recomputing every request", reason,
                  "alive" if executor_alive else "lost, waiting for it to return")
        svc.degraded = None if executor_alive else f"executor lost: {reason}"
        svc.beat(force=True)                                         # /health: degraded
        if plan is not None:
            svc.emit(self._fail_culprits(plan, reason))
        svc.flush_outputs()
        svc.executors.close()
        while not svc.stopping:
            try:
                with beating(svc):
                    svc.connect(timeout_s=2.0)
                break
            except ExecutorTaken:
                raise
            except Exception as exc:  # timeouts and gRPC errors while it restarts
                svc.degraded = f"executor lost: {reason}"
                log.warning("executor not back yet: %s", exc)
                svc.beat()
        svc.degraded = None
        svc.beat(force=True)
        log.info("executor is back; %d requests continue by recompute", len(svc.requests))

    def _fail_culprits(self, plan: StepPlan, reason: str) -> list[RequestOutput]:
        """Count a loss against each request of `plan`; end those over the limit with an
        error (their final output says why)."""
        svc = self.service
        rows = set(plan.seq_ids)
        failed = []
        for group in list(svc.requests.values()):
            if not any(seq.seq_id in rows for seq in group.seqs):
                continue
            lost = self.losses[group.request_id] = self.losses.get(group.request_id, 0) + 1
            if lost > svc.config.max_step_retries:
                out = svc.sched.abort_request(group.request_id, "error")
                out.error = (f"the model step failed {lost} times while running this "
                             f"request: {reason}")
                out.error_code = 500
                failed.append(out)
        return failed

    def forget(self, request_id: str) -> None:
        """The request ended: its losses no longer count."""
        self.losses.pop(request_id, None)

    def reclaim_pending(self, include_self: bool = False) -> None:
        """Take over requests read by this name before a restart, or by a dead scheduler.

        A request that had already streamed output continues from there: it is admitted
        with the tokens its stream holds and recomputes them (see resume_group), so its
        client sees one unbroken stream. One whose final output was published is only
        acknowledged.
        """
        svc = self.service
        link = svc.link
        dead = link.dead_schedulers(link.now())
        for name in ([svc.config.name] if include_self else []) + dead:
            inbound = link.take_pending(name)
            if not inbound.requests and not inbound.malformed:
                continue
            svc.take(inbound)
            started = 0
            for eid, req in inbound.requests:
                tokens, ended, finished = link.published(req.request_id)
                if finished:
                    svc.inbox.remove((eid, req))
                    svc.to_ack.append(eid)
                elif tokens or ended:
                    started += 1
                    self.resume[req.request_id] = (tokens, ended)
            log.warning("reclaimed %d pending requests of %s (%d continue where their "
                        "stream stopped)", len(inbound.requests), name, started)
        svc.flush_outputs()

    def resume_group(self, group: SequenceGroup) -> None:
        """A request taken over from a scheduler that died: its seqs start from the tokens
        their stream already holds (recomputed with the prompt, as after a preemption), and
        the choices that ended are not run again (then `group.seqs` may be empty). Beams
        stream nothing before they end, so a beam search starts over."""
        taken = self.resume.pop(group.request_id, None)
        if taken is None or group.is_beam:
            return
        tokens, ended = taken
        for seq in list(group.seqs):
            if seq.sample_index in ended:
                group.seqs.remove(seq)
            else:
                seq.token_ids.extend(tokens.get(seq.sample_index, ()))
        group.first_output_sent = True
