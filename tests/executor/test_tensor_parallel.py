"""Tensor parallelism: N real executor processes in a gloo group give TP=1's greedy tokens.

Each rank is a real `pagedserve executor --rank r` process; the test drives them the way the
scheduler does (every plan pushed over ZeroMQ to every rank, the result pulled from rank 0)
and runs the very same plans through one in-process TP=1 runner. The plans mix chunked
prefill with decodes and force a swap out / swap in and a recompute mid-generation, so the
sharded KV pool, the cache operations and the all-reduces are all on the path.
"""
from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import zmq

from shared.control import ExecutorClient, owner_identity
from shared.messages import SamplingParams, StepPlan, StepResult
from shared.wire import decode, encode
from services.launcher import free_port, free_ports
from tests.conftest import REPO, stop_process
from tests.executor.conftest import make_tiny_checkpoint, tiny_runner
from tests.executor.plans import PlanBuilder

GREEDY = SamplingParams(temperature=0.0)
BLOCK, GPU_BLOCKS, BUDGET, NEW = 4, 64, 24, 12
OWNER = "tp-test"          # the scheduler this test plays (it takes the executor over)
PROMPTS = [[5, 17, 33, 101, 7, 64, 9, 250, 3, 44, 12], [1, 2, 3],
           [200, 199, 198, 7, 7, 7, 7, 30, 31, 32, 90, 91, 92, 93, 94, 95, 96], [42]]


class RankGroup:
    """The ranks of one tensor-parallel executor, as processes, and a ZeroMQ driver."""

    def __init__(self, model: str, tp: int, *flags: str) -> None:
        self.grpc, self.zmq_port, dist = free_ports(tp), free_ports(tp + 1), free_port()
        self.plans, self.results = [], None
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "services.launcher", "executor", "--model", model,
             "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", str(tp),
             "--rank", str(r), "--grpc-port", str(self.grpc), "--zmq-port", str(self.zmq_port),
             "--dist-port", str(dist), "--num-threads", "1", "--max-model-len", "512",
             "--log-level", "warning", *flags],
            cwd=REPO, start_new_session=True) for r in range(tp)]
        self.client = ExecutorClient(f"127.0.0.1:{self.grpc}")
        deadline = time.monotonic() + 300
        while not self.client.is_alive(1.0):
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.close()
                pytest.fail(f"executor ranks {dead} exited during start-up" if dead else
                            "the executor ranks did not come up in 300 s")
            time.sleep(0.2)
        self.info = self.client.describe()
        self.fence = self.client.reset(owner=OWNER).fence     # this test owns the group
        ctx = zmq.Context.instance()
        for ep in self.info.plan_endpoints:
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            self.plans.append(s)
        self.results = ctx.socket(zmq.DEALER)
        self.results.setsockopt(zmq.LINGER, 0)
        self.results.setsockopt(zmq.IDENTITY, owner_identity(OWNER, self.fence))
        self.results.setsockopt(zmq.RCVTIMEO, 120_000)
        self.results.connect(self.info.result_endpoint)

    def execute(self, plan: StepPlan) -> StepResult:
        plan.fence = self.fence
        data = encode(plan)
        for s in self.plans:
            s.send(data)
        return decode(self.results.recv(), StepResult)

    def close(self) -> None:
        for s in self.plans + [self.results] * (self.results is not None):
            s.close()
        for p in self.procs:
            stop_process(p, timeout=10)


def generate(execute, prompts=PROMPTS, new=NEW, preempt=True) -> list[list[int]]:
    """Greedy outputs of `prompts` run together; seq 0 is swapped out and back in and seq 1
    recomputed part-way, when `preempt`."""
    b = PlanBuilder(GPU_BLOCKS, 16, BLOCK, BUDGET)
    for i, p in enumerate(prompts):
        b.add(i, p, GREEDY, new)
    steps = 0
    while not b.done:
        steps += 1
        if preempt and steps == 6:
            b.swap_out(0)
            b.recompute(1)
        if preempt and steps == 8:
            b.swap_in(0)
        b.apply(execute(b.next_plan()))
        assert steps < 500, "generation does not finish"
    execute(b.next_plan())   # drops the finished seqs on the executor side
    return [b.seqs[i].outputs for i in range(len(prompts))]


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    """A tiny random Llama with 8 attention heads and 4 KV heads (GQA 2)."""
    folder = tmp_path_factory.mktemp("tiny-llama-8h")
    make_tiny_checkpoint(folder, num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=96)
    return folder


def test_tp2_tiny_llama_equals_tp1(tiny8):
    ref = tiny_runner(tiny8, num_gpu_blocks=GPU_BLOCKS, block_size=BLOCK,
                      swap_space_gib=0.001)
    want = generate(ref.execute)
    assert all(len(o) == NEW for o in want)
    group = RankGroup(str(tiny8), 2, "--num-gpu-blocks", str(GPU_BLOCKS), "--block-size",
                      str(BLOCK), "--swap-space-gib", "0.001")
    try:
        assert group.info.tensor_parallel_size == 2
        assert group.info.num_gpu_blocks == GPU_BLOCKS
        assert len(group.info.plan_endpoints) == 2
        assert generate(group.execute) == want
        # Reset reaches every rank: a seq known before is unknown to rank 0 and rank 1 after.
        b = PlanBuilder(GPU_BLOCKS, 16, BLOCK, BUDGET)
        b.add(7, PROMPTS[0], GREEDY, 3)
        b.apply(group.execute(b.next_plan()))
        assert group.client.reset(owner=OWNER).dropped_seqs == 1
        for r in (0, 1):
            h = ExecutorClient(f"127.0.0.1:{group.grpc + r}").health()
            assert h.ok and h.live_seqs == 0, (r, h)
    finally:
        group.close()


def test_a_lost_rank_makes_rank_0_unhealthy(tiny8):
    group = RankGroup(str(tiny8), 2, "--num-gpu-blocks", "16", "--block-size", str(BLOCK))
    try:
        assert group.client.health().ok
        group.procs[1].kill()
        group.procs[1].wait()
        h = group.client.health(timeout=3.0)
        assert not h.ok and "1" in h.status
    finally:
        group.close()


def test_heads_that_do_not_split_are_refused_with_the_sizes_that_work(tiny8):
    from services.executor.parallel import TensorParallelError

    # 4 KV heads over 3 ranks: refused before the rank waits for a group that cannot work.
    with pytest.raises(TensorParallelError, match=r"8 attention heads and 4 key/value heads.*"
                       r"3 ranks.*divides both \(1, 2, 4\)"):
        tiny_runner(tiny8, tensor_parallel_size=3, rank=0)


def _listening(pids: set[int]) -> list[str]:
    """Local addresses of the TCP sockets that processes `pids` listen on."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            found.append(line.split()[3])
    return found


def _is_loopback(address: str) -> bool:
    """`ss`'s local address ("127.0.0.1:5", "[::ffff:127.0.0.1]:5", "*:5") is loopback."""
    try:
        ip = ipaddress.ip_address(address.rsplit(":", 1)[0].strip("[]").split("%")[0])
    except ValueError:      # "*": every interface
        return False
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def test_the_ranks_listen_on_loopback_only_and_shutdown_stops_every_rank(tiny8):
    group = RankGroup(str(tiny8), 2, "--num-gpu-blocks", "16", "--block-size", str(BLOCK))
    try:
        pids = {p.pid for p in group.procs}
        addresses = _listening(pids)
        # gRPC and ZeroMQ of both ranks, and the rendezvous store of rank 0 at least
        assert len(addresses) >= 6, addresses
        assert all(_is_loopback(a) for a in addresses), "\n".join(addresses)
        group.client.shutdown()
        deadline = time.monotonic() + 30
        while any(p.poll() is None for p in group.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p.poll() for p in group.procs] == [0, 0], "a rank outlived Shutdown"
    finally:
        group.close()


def test_rank_0_exits_when_a_rank_it_started_dies_while_the_group_is_idle(tiny8):
    """No step runs, so no collective fails: rank 0's watch over the ranks it started is
    what stops the group (status 1, for a supervisor to restart it)."""
    grpc, zmq_port, dist = free_ports(2), free_ports(3), free_port()
    rank0 = subprocess.Popen(
        [sys.executable, "-m", "services.launcher", "executor", "--model", str(tiny8),
         "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2",
         "--grpc-port", str(grpc), "--zmq-port", str(zmq_port), "--dist-port", str(dist),
         "--num-threads", "1", "--max-model-len", "512", "--num-gpu-blocks", "16",
         "--block-size", str(BLOCK), "--log-level", "warning"],
        cwd=REPO, start_new_session=True)
    try:
        client = ExecutorClient(f"127.0.0.1:{grpc}")
        deadline = time.monotonic() + 300
        while not client.is_alive(1.0):
            assert rank0.poll() is None and time.monotonic() < deadline, "rank 0 never came up"
            time.sleep(0.2)
        with open(f"/proc/{rank0.pid}/task/{rank0.pid}/children") as f:
            children = [int(p) for p in f.read().split()]
        assert len(children) == 1, children
        os.kill(children[0], signal.SIGKILL)
        assert rank0.wait(timeout=30) == 1
    finally:
        stop_process(rank0, timeout=10)
