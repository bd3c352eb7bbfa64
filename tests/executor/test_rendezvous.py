"""The tensor-parallel rendezvous store (torch's TCPStore, unauthenticated writes) listens on
the address it was given and nowhere else, and a port in use is one line, not a traceback.
Real sockets; the port-in-use case on a real executor process."""
from __future__ import annotations

import socket
import subprocess
import sys
from datetime import timedelta

import pytest

from services.executor.config import ExecutorConfigError
from services.executor.parallel import Shard, _rendezvous_store
from services.launcher import free_port
from tests.conftest import REPO
from tests.executor.conftest import make_tiny_checkpoint

TIMEOUT = timedelta(seconds=10)


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except ConnectionRefusedError:
        return False


def _busy(host: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind((host, port))
    sock.listen(1)
    return sock


@pytest.mark.parametrize("bound, other", [("127.0.0.2", "127.0.0.1"),
                                          ("127.0.0.1", "127.0.0.2")])
def test_the_store_listens_on_its_host_only(bound, other):
    # Both are addresses of this machine (all of 127/8 is loopback on Linux): a store that
    # listened on every interface would take the connection on either.
    port = free_port()
    store = _rendezvous_store(Shard(0, 2), bound, port, TIMEOUT)
    assert _connects(bound, port)
    assert not _connects(other, port), f"the store bound to {bound} answered on {other}"
    # ... and it is the store there: rank 1 joins it and the two share a key.
    peer = _rendezvous_store(Shard(1, 2), bound, port, TIMEOUT)
    peer.set("hello", "from rank 1")
    assert store.get("hello") == b"from rank 1"


def test_a_port_in_use_is_one_line():
    port = free_port()
    held = _busy("127.0.0.1", port)
    try:
        with pytest.raises(ExecutorConfigError) as caught:
            _rendezvous_store(Shard(0, 2), "127.0.0.1", port, TIMEOUT)
    finally:
        held.close()
    message = str(caught.value)
    assert "\n" not in message
    assert f"cannot listen on 127.0.0.1:{port}" in message and "--dist-port" in message


def test_an_executor_whose_rendezvous_port_is_in_use_stops_with_one_line(tmp_path):
    make_tiny_checkpoint(tmp_path, num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=96)
    port = free_port()
    held = _busy("127.0.0.1", port)
    try:
        # rank 0 alone (--rank given: it starts no other rank); it fails before waiting for one
        proc = subprocess.run(
            [sys.executable, "-m", "services.launcher", "executor", "--model", str(tmp_path),
             "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2",
             "--rank", "0", "--grpc-port", str(free_port()), "--zmq-port", str(free_port()),
             "--dist-port", str(port), "--max-model-len", "512", "--log-level", "error"],
            cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        held.close()
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"pagedserve executor: the tensor-parallel rendezvous cannot listen on "
                     f"127.0.0.1:{port} (Address already in use): free the port or pass "
                     f"another --dist-port"], proc.stderr
