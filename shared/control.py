"""gRPC control-plane helpers shared by the executor (server) and the scheduler (client).

Reset and Shutdown change who owns an executor, or stop it: when PAGEDSERVE_CONTROL_TOKEN is
set (in the environment only: a secret never goes on a command line), the executor refuses
them (PERMISSION_DENIED) unless the caller's metadata carries the same token. `serve` makes
one per stack; under compose, set it in the environment of the executor and the scheduler.

The .proto lives in shared/proto/control.proto; control_pb2*.py are generated from it with
`python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. shared/proto/control.proto`.
"""
from __future__ import annotations

import hmac
import os

import grpc

from shared.proto import control_pb2 as pb
from shared.proto import control_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc", "ExecutorClient", "owner_identity"]


OWNER_LEASE_S = 5.0    # an executor's owner silent this long may be replaced by another
CONTROL_TOKEN_ENV = "PAGEDSERVE_CONTROL_TOKEN"
_TOKEN_KEY = "x-pagedserve-control-token"      # gRPC metadata key (lower case, as gRPC wants)


def control_token() -> str:
    return os.environ.get(CONTROL_TOKEN_ENV, "")


def token_matches(expected: str, context) -> bool:
    """Whether a call's metadata carries `expected` (any call passes when it is empty)."""
    if not expected:
        return True
    given = dict(context.invocation_metadata()).get(_TOKEN_KEY, "")
    return hmac.compare_digest(given.encode(), expected.encode())


def owner_identity(owner: str, fence: int) -> bytes:
    """The ZeroMQ identity of an owner's result socket (DEALER, connected to the executor's
    ROUTER): the executor addresses each result to the owner of its plan's token."""
    return f"{owner}#{fence}".encode()


class ExecutorClient:
    """A thin, timeout-bounded client of one executor's control service."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.address = address
        token = control_token() if token is None else token
        self._auth = ((_TOKEN_KEY, token),) if token else ()
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.ExecutorControlStub(self._channel)

    def describe(self, timeout: float = 5.0) -> pb.ExecutorInfo:
        return self._stub.Describe(pb.DescribeRequest(), timeout=timeout)

    def health(self, timeout: float = 1.0, owner: str = "") -> pb.HealthReply:
        """`owner`: the owner renews its lease (ResetRequest in control.proto)."""
        return self._stub.Health(pb.HealthRequest(owner=owner), timeout=timeout)

    def reset(self, timeout: float = 5.0, owner: str = "") -> pb.ResetReply:
        return self._stub.Reset(pb.ResetRequest(owner=owner), timeout=timeout,
                                metadata=self._auth)

    def shutdown(self, timeout: float = 2.0) -> None:
        self._stub.Shutdown(pb.ShutdownRequest(), timeout=timeout, metadata=self._auth)

    def is_alive(self, timeout: float = 1.0) -> bool:
        try:
            return self.health(timeout).ok
        except grpc.RpcError:
            return False

    def wait_ready(self, timeout: float) -> pb.ExecutorInfo:
        """Block until the executor answers Describe (it loads the model first)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"executor at {self.address} did not come up in {timeout:.0f} s") from None
        return self.describe(timeout=timeout)

    def close(self) -> None:
        self._channel.close()
