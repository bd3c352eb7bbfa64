"""The scheduler's data plane to the executors: plans out, results back, over ZeroMQ.

    plan   ── PUSH, one socket per executor rank ──▶ every rank runs the same plan
    result ◀── DEALER ── rank 0's ROUTER             (the identity names this scheduler and
                                                      its fence: a fenced one gets nothing)

The control plane (readiness, ownership, health) is gRPC (shared/control.py); what travels
here is declared in shared/messages.py and encoded by shared/wire.py.
"""
from __future__ import annotations

import zmq

from shared.messages import StepResult
from shared.wire import MAX_MESSAGE_BYTES, decode


class ExecutorLink:
    def __init__(self) -> None:
        self.context = zmq.Context.instance()
        self.plan_socks: list[zmq.Socket] = []
        self.result_sock: zmq.Socket | None = None

    def connect(self, plan_endpoints: list[str], result_endpoint: str, identity: bytes) -> None:
        """(Re)connect to the executors' endpoints, dropping any earlier sockets."""
        self.close()
        for ep in plan_endpoints:
            s = self.context.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            self.plan_socks.append(s)
        self.result_sock = self.context.socket(zmq.DEALER)
        self.result_sock.setsockopt(zmq.LINGER, 0)
        self.result_sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.result_sock.setsockopt(zmq.IDENTITY, identity)
        self.result_sock.connect(result_endpoint)

    def close(self) -> None:
        """Close the sockets (they would reconnect to whatever binds there next)."""
        for sock in self.plan_socks + [self.result_sock]:
            if sock is not None:
                sock.close()
        self.plan_socks, self.result_sock = [], None

    def send(self, plan_bytes: bytes) -> None:
        """One encoded plan to every rank."""
        for sock in self.plan_socks:
            sock.send(plan_bytes, copy=False)

    def recv(self, timeout_ms: int) -> StepResult | None:
        """The next result, or None when none came within `timeout_ms`."""
        if not self.result_sock.poll(timeout_ms):
            return None
        return decode(self.result_sock.recv(), StepResult)
