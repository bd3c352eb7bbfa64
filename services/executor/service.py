"""The executor process: a ModelRunner behind a ZeroMQ data plane and a gRPC control plane.

    scheduler ──PUSH StepPlan──▶ [PULL   tcp://host:zmq_port+1+rank]  every rank
    scheduler ◀DEALER StepResult [ROUTER tcp://host:zmq_port]          rank 0 only
    scheduler ──gRPC Describe / Health / Reset / Shutdown──▶ [grpc_port] rank 0
    rank 0 ────gRPC Health / Reset / Shutdown──▶ [grpc_port+rank]     ranks 1..N-1

The executor binds and the scheduler connects, so a restarted scheduler finds the executor
where it was. Plans are executed strictly one at a time, in arrival order. The executor
decides no policy: it does what the plan says.

One owner at a time. `Reset(owner)` makes a scheduler the owner and hands it a fencing
token (`fence`); a plan with another token is refused with an error result, and results go
to the owner's socket only (ROUTER, addressed by `owner#fence`), never dealt round-robin
among connected schedulers. While the owner renews its lease (a plan of its fence, or a
Health call naming it, at least every OWNER_LEASE_S) a Reset by another scheduler is
refused: it stands by and takes over when the owner has gone silent.

With tensor parallelism the ranks of one executor run on one host. Rank 0 speaks for the
group on the control plane: its Health is ok only while every rank answers, and Reset and
Shutdown reach every rank. A rank whose collective fails exits (status 1): the group can
only be restarted as a whole.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import zmq

from services.executor.config import ExecutorConfig
from shared.control import (CONTROL_TOKEN_ENV, OWNER_LEASE_S, control_token, owner_identity, pb,
                            pb_grpc, token_matches)
from shared.messages import StepPlan, StepResult
from shared.wire import MAX_MESSAGE_BYTES, WireError, decode, encode, oversized

log = logging.getLogger("pagedserve.executor")

RESULT_SEND_S = 2.0            # a result waits this long for its owner's socket to connect


@dataclass(slots=True)
class ExecutorServiceConfig:
    runner: ExecutorConfig = field(default_factory=ExecutorConfig)
    bind_host: str = "127.0.0.1"        # loopback unless configured: the wires are unauthenticated
    advertise_host: str | None = None   # host the scheduler should dial (default: bind_host)
    grpc_port: int = 50051
    zmq_port: int = 5559                # results (rank 0); plans on zmq_port + 1 + rank

    @property
    def rank(self) -> int:
        return self.runner.rank

    @property
    def tensor_parallel_size(self) -> int:
        return self.runner.tensor_parallel_size

    def endpoint(self, port: int) -> str:
        host = self.advertise_host or self.bind_host
        if host in ("0.0.0.0", "::", "*"):
            host = "127.0.0.1"
        return f"tcp://{host}:{port}"


class _Control(pb_grpc.ExecutorControlServicer):
    def __init__(self, server: "ExecutorServer") -> None:
        self.server = server
        self.token = control_token()      # read once: Reset/Shutdown need it when set

    def Describe(self, request, context):
        return self.server.describe()

    def Health(self, request, context):
        s = self.server
        s.renew(request.owner)
        lost = s.lost_peers()
        status = f"rank(s) {', '.join(map(str, lost))} not answering" if lost else "ok"
        return pb.HealthReply(ok=not lost, status=status, steps=s.steps,
                              uptime_s=time.time() - s.started_at, live_seqs=s.live_seqs(),
                              fence=s.fence, instance_id=s.instance_id, busy_s=s.busy_s)

    def Reset(self, request, context):
        self._check_token(context)
        return self.server.take_over(request.owner)

    def Shutdown(self, request, context):
        self._check_token(context)
        self.server.stop()
        return pb.ShutdownReply()

    def _check_token(self, context) -> None:
        if not token_matches(self.token, context):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"wrong or missing control token: give the caller the executor's "
                          f"{CONTROL_TOKEN_ENV}")


class ExecutorServer:
    def __init__(self, config: ExecutorServiceConfig, runner=None) -> None:
        from services.executor.model_runner import ModelRunner

        self.config = config
        self.runner = runner if runner is not None else ModelRunner(config.runner)
        self.instance_id = uuid.uuid4().hex
        self.started_at = time.time()
        self.steps = 0
        self.busy_s = 0.0                  # on plans, from receipt to the result sent
        self._lock = threading.Lock()      # one plan (or reset) at a time
        self._stop = threading.Event()
        self._zmq = zmq.Context.instance()
        self._grpc: grpc.Server | None = None
        self.exit_code = 0
        # Ownership (see the module docstring): the owner's name and token, when it last
        # renewed its lease (monotonic s), and the names of earlier tokens (to answer a
        # fenced owner's plan on its own socket).
        self.owner, self.fence, self.owner_seen = "", 0, 0.0
        self.owners: dict[int, str] = {}
        # On the CPU: registered with the host's other executors; with the automatic thread
        # count and one rank, its threads are the cores shared out over the busy ones.
        self.host_share = None
        self.adapt_threads = False
        if getattr(getattr(self.runner, "device", None), "type", None) == "cpu":
            import torch

            from services.executor.host_share import HostShare
            try:
                self.host_share = HostShare(torch.get_num_threads())
            except OSError as exc:
                log.warning("not sharing the cores with other executors: %s", exc)
            self.adapt_threads = (config.runner.num_threads == 0
                                  and config.tensor_parallel_size == 1)
        # Rank 0 reaches the other ranks' control servers (on this host).
        self.peers = []
        if config.rank == 0:
            from shared.control import ExecutorClient
            host = config.endpoint(0).removeprefix("tcp://").rsplit(":", 1)[0]
            self.peers = [ExecutorClient(f"{host}:{config.grpc_port + r}")
                          for r in range(1, config.tensor_parallel_size)]

    # ------------------------------------------------------------ control plane
    def describe(self) -> pb.ExecutorInfo:
        r, c = self.runner, self.config
        plan_eps = [c.endpoint(c.zmq_port + 1 + rank) for rank in range(c.tensor_parallel_size)]
        return pb.ExecutorInfo(
            model=r.model_name, dtype=str(r.dtype).removeprefix("torch."), device=str(r.device),
            block_size=r.block_size, num_gpu_blocks=r.num_gpu_blocks,
            num_cpu_blocks=r.num_cpu_blocks, max_model_len=r.max_model_len,
            eos_token_id=int(r.eos_token_id if r.eos_token_id is not None else -1),
            plan_endpoints=plan_eps, result_endpoint=c.endpoint(c.zmq_port),
            tensor_parallel_size=c.tensor_parallel_size, instance_id=self.instance_id)

    def live_seqs(self) -> int:
        return len(self.runner.seqs)

    def lost_peers(self) -> list[int]:
        """Ranks (other than this one) that do not answer Health, or this rank if broken."""
        lost = [0] if self.runner.broken else []
        return lost + [r for r, peer in enumerate(self.peers, 1) if not peer.is_alive(0.5)]

    def renew(self, owner: str, fence: int | None = None) -> None:
        if owner and owner == self.owner and fence in (None, self.fence):
            self.owner_seen = time.monotonic()

    def take_over(self, owner: str) -> pb.ResetReply:
        """Reset for a new owner, unless another one holds a live lease."""
        with self._lock:
            now = time.monotonic()
            if (owner != self.owner and self.owner
                    and now - self.owner_seen < OWNER_LEASE_S):
                return pb.ResetReply(fence=0, holder=self.owner)
            self.fence += 1
            self.owner, self.owner_seen = owner, now
            self.owners[self.fence] = owner
            if len(self.owners) > 64:
                del self.owners[min(self.owners)]
        return pb.ResetReply(dropped_seqs=self.reset(), fence=self.fence)

    def reset(self) -> int:
        """Drop every sequence's state (block tables included) on every rank; the pool
        contents are simply overwritten later, so nothing needs clearing."""
        with self._lock:
            dropped = len(self.runner.seqs)
            self.runner.seqs.clear()
        for peer in self.peers:
            peer.reset()
        return dropped

    def stop(self) -> None:
        self._stop.set()
        for peer in self.peers:
            try:
                peer.shutdown(timeout=1.0)
            except grpc.RpcError:
                pass   # already gone

    # ------------------------------------------------------------ data plane
    def serve(self) -> None:
        c = self.config
        plans = self._zmq.socket(zmq.PULL)
        plans.setsockopt(zmq.LINGER, 0)
        plans.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        plans.bind(f"tcp://{c.bind_host}:{c.zmq_port + 1 + c.rank}")
        results = None
        if c.rank == 0:
            results = self._zmq.socket(zmq.ROUTER)
            results.setsockopt(zmq.LINGER, 0)
            results.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            results.setsockopt(zmq.ROUTER_MANDATORY, 1)     # an unknown peer: an error
            # The same owner reconnecting (a new socket after a Reset) replaces its old one.
            results.setsockopt(zmq.ROUTER_HANDOVER, 1)
            results.bind(f"tcp://{c.bind_host}:{c.zmq_port}")
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_ExecutorControlServicer_to_server(_Control(self), self._grpc)
        self._grpc.add_insecure_port(f"{c.bind_host}:{c.grpc_port + c.rank}")
        self._grpc.start()
        log.info("executor rank %d ready: %s, %d GPU blocks, %d CPU blocks", c.rank,
                 self.runner.model_name, self.runner.num_gpu_blocks, self.runner.num_cpu_blocks)
        poller = zmq.Poller()
        poller.register(plans, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(200):
                    continue
                t0 = time.perf_counter()
                if self.host_share is not None:
                    self._share_cores()
                to, reply = self._execute(plans.recv())
                if results is not None and reply is not None:
                    self._send_result(results, to, reply)
                self.busy_s += time.perf_counter() - t0
                if self.runner.broken:
                    log.critical("tensor-parallel step failed on rank %d; the executor group "
                                 "is out of step and must be restarted", c.rank)
                    self.exit_code = 1
                    self.stop()
        finally:
            plans.close()
            if self.host_share is not None:
                self.host_share.close()
            if results is not None:
                results.close()
            if self._grpc is not None:
                self._grpc.stop(grace=0.5)

    def _share_cores(self) -> None:
        """Mark this executor busy; with the automatic thread count, run as many threads as
        the host's busy executors leave it (on this thread: it runs the forward)."""
        threads = self.host_share.share()
        if self.adapt_threads:
            import torch
            if torch.get_num_threads() != threads:
                log.debug("%d threads: %d other executors busy on this host", threads,
                          self.host_share.peers)
                torch.set_num_threads(threads)

    def _send_result(self, sock, to: bytes, reply: bytes) -> None:
        """To the owner `to` only. Its socket may still be connecting (a plan can overtake
        the result socket's handshake): wait a little for it, then drop the result (its
        sender's step deadline and health checks take over)."""
        deadline = time.monotonic() + RESULT_SEND_S
        while True:
            try:
                sock.send_multipart([to, reply], flags=zmq.NOBLOCK)
                return
            except zmq.ZMQError as exc:
                if time.monotonic() > deadline or self._stop.is_set():
                    log.warning("result for %s dropped: %s", to.decode(errors="replace"), exc)
                    return
                time.sleep(0.002)

    def _execute(self, data: bytes) -> tuple[bytes, bytes | None]:
        """(the owner identity the result goes to, the encoded result)."""
        to = owner_identity(self.owner, self.fence)
        try:
            plan = decode(data, StepPlan)
        except WireError as exc:
            log.error("dropping malformed plan: %s", exc)
            return to, encode(StepResult(step_id=-1, error=f"malformed plan: {exc}"))
        with self._lock:
            if plan.fence != self.fence:
                # A stale owner (another scheduler took over): refused, on its own socket.
                sender = self.owners.get(plan.fence, "")
                return owner_identity(sender, plan.fence), encode(StepResult(
                    step_id=plan.step_id, error=f"fenced: plan of token {plan.fence}, but "
                    f"the executor's owner is now {self.owner!r} (token {self.fence})"))
            self.owner_seen = time.monotonic()
            try:
                result = self.runner.execute(plan)
            except Exception as exc:  # the runner reports its own errors; this is a last resort
                log.exception("step %d failed", plan.step_id)
                result = StepResult(step_id=plan.step_id, error=f"executor error: {exc}")
            self.steps += 1
        data = encode(result)
        too_big = oversized(data, f"the result of step {plan.step_id}")
        if too_big is not None:
            # Sent, it would cut the scheduler's connection (see MAX_MESSAGE_BYTES): the
            # step fails instead, as any failed step does.
            log.error("%s; answering with an error", too_big)
            data = encode(StepResult(step_id=plan.step_id, error=too_big))
        return to, data


def run(config: ExecutorServiceConfig, ranks=()) -> int:
    """Serve until stopped; returns the exit status. `ranks`: child processes of the other
    tensor-parallel ranks (started by the launcher): losing one stops this one too."""
    holder: list[ExecutorServer] = []

    def watch() -> None:
        while not (holder and holder[0]._stop.is_set()):
            for r, proc in enumerate(ranks, 1):
                if proc.poll() is not None:
                    log.critical("executor rank %d exited with status %s; stopping the group",
                                 r, proc.returncode)
                    if not holder:      # still joining the group, which can never complete
                        os._exit(1)
                    holder[0].exit_code = 1
                    holder[0].stop()
                    return
            time.sleep(0.5)
    if ranks:
        threading.Thread(target=watch, name="rank-watch", daemon=True).start()
    server = ExecutorServer(config)
    holder.append(server)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server._stop.set())
    server.serve()
    server.runner.group.close()
    return server.exit_code
