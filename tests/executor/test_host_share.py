"""CPU executors on one host share the cores (services/executor/host_share.py): real
processes register in a real folder; a busy one halves the others' threads, an idle or
dead one takes nothing, and one pinned to other CPUs is not counted."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from services.executor import host_share
from services.executor.host_share import HostShare
from tests.conftest import REPO

PEER = textwrap.dedent("""
    import os, sys, time
    from services.executor.host_share import HostShare
    folder, busy, cpus = sys.argv[1], sys.argv[2] == "busy", sys.argv[3]
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    share = HostShare(2, folder)
    if busy:
        share.mark_busy()
    print("ready", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def peers(tmp_path):
    procs = []

    def start(busy: bool = True, cpus: str = "") -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", PEER, str(tmp_path), "busy" if busy
                              else "idle", cpus], cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _fresh(share: HostShare) -> int:
    share._checked = float("-inf")           # read the register now, not CHECK_S later
    return share.share()


def test_a_busy_peer_halves_the_threads_an_idle_one_takes_none(tmp_path, peers):
    me = HostShare(8, str(tmp_path))
    try:
        assert _fresh(me) == 8
        peers(busy=False)
        assert _fresh(me) == 8, "a registered executor that runs no step takes no cores"
        peers(busy=True)
        assert _fresh(me) == 4 and me.peers == 1
        peers(busy=True)
        assert _fresh(me) == 2           # 8 threads over three busy executors
    finally:
        me.close()
    assert not os.path.exists(me.path)


def test_a_peer_that_stops_stepping_gives_its_share_back(tmp_path, peers):
    me = HostShare(2, str(tmp_path))
    try:
        peers(busy=True)
        assert _fresh(me) == 1
        time.sleep(host_share.BUSY_S + 0.3)  # no step from it since
        assert _fresh(me) == 2
    finally:
        me.close()


def test_a_killed_peer_is_dropped_from_the_register(tmp_path, peers):
    me = HostShare(2, str(tmp_path))
    try:
        p = peers(busy=True)
        assert _fresh(me) == 1
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert _fresh(me) == 2
        assert os.listdir(tmp_path) == [os.path.basename(me.path)], "the dead one's file stays"
    finally:
        me.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_peer_pinned_to_other_cpus_is_not_counted(tmp_path, peers):
    mine, other = sorted(os.sched_getaffinity(0))[:2]
    os.sched_setaffinity(0, {mine})
    try:
        me = HostShare(2, str(tmp_path))
        peers(busy=True, cpus=str(other))
        assert _fresh(me) == 2
        peers(busy=True, cpus=f"{mine},{other}")
        assert _fresh(me) == 1
        me.close()
    finally:
        os.sched_setaffinity(0, set(range(os.cpu_count())))


class _CpuRunner:
    device = torch.device("cpu")
    tensor_parallel_size = 1


def test_the_executor_service_runs_its_share_of_threads_between_steps(tmp_path, peers):
    from services.executor.service import ExecutorServer, ExecutorServiceConfig

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    server = ExecutorServer(ExecutorServiceConfig(), runner=_CpuRunner())
    try:
        assert server.adapt_threads and server.host_share is not None
        server.host_share.close()
        server.host_share = HostShare(torch.get_num_threads(), str(tmp_path))
        server._share_cores()
        assert torch.get_num_threads() == 2
        assert os.stat(server.host_share.path).st_mtime > time.time() - 5, \
            "a step must mark the executor busy for the others"
        p = peers(busy=True)
        server.host_share._checked = float("-inf")
        server._share_cores()
        assert torch.get_num_threads() == 1
        p.kill()
        p.wait()
        server.host_share._checked = float("-inf")
        server._share_cores()
        assert torch.get_num_threads() == 2
    finally:
        server.host_share.close()
        torch.set_num_threads(before)


def test_a_fixed_thread_count_is_kept(tmp_path, peers):
    from services.executor.config import ExecutorConfig
    from services.executor.service import ExecutorServer, ExecutorServiceConfig

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    server = ExecutorServer(ExecutorServiceConfig(runner=ExecutorConfig(num_threads=2)),
                            runner=_CpuRunner())
    try:
        assert not server.adapt_threads
        server.host_share.close()
        server.host_share = HostShare(2, str(tmp_path))
        peers(busy=True)
        server._share_cores()
        assert torch.get_num_threads() == 2
        assert server.host_share.peers == 1     # it still counts (and is counted)
    finally:
        server.host_share.close()
        torch.set_num_threads(before)


def test_an_entry_still_being_made_is_neither_counted_nor_removed(tmp_path):
    # (an executor makes its entry under a hidden name and renames it once it holds the
    # lock: until then it is unlocked, and must not be taken for a dead process's)
    making = tmp_path / ".4242-0000abcd"
    making.write_text("0")
    me = HostShare(2, str(tmp_path))
    try:
        assert _fresh(me) == 2 and making.exists()
        assert sorted(os.listdir(tmp_path)) == sorted([making.name,
                                                       os.path.basename(me.path)])
    finally:
        me.close()
