"""Fair admission between tenants (services/scheduler/fairness.py) against the FakeExecutor."""
from __future__ import annotations

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from shared.messages import GenerationRequest, SamplingParams
from tests.scheduler.fake_executor import FakeExecutor


def admission_order(requests: list[tuple[str, str, int]], policy: str = "fcfs",
                    priorities: dict | None = None) -> list[str]:
    """Request ids in the order they are admitted with one seat, all queued before the first
    step. requests: (request id, tenant, n)."""
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_seqs=16, max_model_len=256,
                                      policy=policy), 256, 0)
    ex = FakeExecutor(256, 0, 4)
    for i, (rid, tenant, n) in enumerate(requests):
        sched.add_request(GenerationRequest(
            rid, [1, 2, 3, 4, 5], SamplingParams(n=n, max_tokens=8, temperature=1.0),
            priority=(priorities or {}).get(rid, 0), arrival_time=float(i), tenant=tenant))
    order = []
    while sched.has_unfinished():
        plan = sched.schedule()
        for ns in plan.new_seqs:
            if ns.request_id not in order:
                order.append(ns.request_id)
        sched.update(plan, ex.execute(plan))
    return order


def test_a_calm_tenant_is_admitted_before_a_flooding_tenants_backlog():
    # The flood queues four requests of 16 sequences (a batch holds one of them); the calm
    # tenant's request, queued last, is admitted next, not after the whole backlog.
    flood = [(f"flood{i}", "f", 16) for i in range(4)]
    order = admission_order(flood + [("calm", "c", 1)])
    assert order == ["flood0", "calm", "flood1", "flood2", "flood3"]


def test_one_tenant_keeps_arrival_order():
    reqs = [(f"r{i}", "t", 1 + i % 3) for i in range(6)]
    assert admission_order(reqs) == [f"r{i}" for i in range(6)]
    assert admission_order([(r, "", n) for r, _, n in reqs]) == [f"r{i}" for i in range(6)]


@pytest.mark.parametrize("calm_priority,expect_calm_at", [(0, 1), (1, 4)])
def test_fairness_orders_within_a_priority_only(calm_priority, expect_calm_at):
    flood = [(f"flood{i}", "f", 16) for i in range(4)]
    order = admission_order(flood + [("calm", "c", 1)], policy="priority",
                            priorities={"calm": calm_priority})
    assert order.index("calm") == expect_calm_at


def _stack(max_num_seqs: int = 32):
    """A scheduler on the FakeExecutor; add(request id, tenant, n, max_tokens) queues a
    request, step() runs one step and returns its plan and the request ids it ran."""
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_seqs=max_num_seqs,
                                      max_model_len=256), 256, 0)
    ex = FakeExecutor(256, 0, 4)

    def add(rid, tenant, n=1, max_tokens=40):
        sched.add_request(GenerationRequest(
            rid, [1, 2, 3, 4, 5], SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0),
            tenant=tenant))

    def step():
        plan = sched.schedule()
        owner = {s.seq_id: g.request_id for g in sched.groups.values() for s in g.seqs}
        sched.update(plan, ex.execute(plan))
        return plan, {owner[i] for i in plan.seq_ids}

    return sched, add, step


def test_a_tenant_with_nothing_running_preempts_another_tenants_latest_group():
    # Two groups of 8 of the flooding tenant hold all 16 seats; the calm tenant's request is
    # admitted in the very next step, by recompute of the flood's latest group, which then
    # waits behind the flood's own queued request; the flood keeps its earliest group.
    sched, add, step = _stack(max_num_seqs=16)
    add("flood0", "f", 8)
    add("flood1", "f", 8)
    add("flood2", "f", 8)
    for _ in range(4):
        step()
    assert [g.request_id for g in sched.running] == ["flood0", "flood1"]
    add("calm", "c", 1, max_tokens=4)
    plan, _ = step()
    assert "calm" in {ns.request_id for ns in plan.new_seqs}
    assert [g.request_id for g in sched.running] == ["flood0", "calm"]
    assert [g.request_id for _, g in sorted(sched.waiting)] == ["flood2", "flood1"]
    while sched.has_unfinished():
        step()
    assert sched.stats().num_preemptions == 1


def test_a_calm_tenants_first_token_gets_a_step_of_its_own_while_another_tenant_floods():
    # The flood runs one n=8 request; the calm tenant's request is admitted in a step that
    # runs it alone (its first token waits for no decode), and the next step runs both.
    sched, add, step = _stack()
    add("flood", "f", n=8)
    for _ in range(4):
        step()
    assert step()[1] == {"flood"}
    add("calm", "c")
    assert step()[1] == {"calm"}
    assert step()[1] == {"flood", "calm"}
    add("calm2", "d")
    assert step()[1] == {"calm2"}
    # Never two first-token steps in a row (the flood's decodes would wait twice running):
    # a request arriving right after one joins the decodes.
    add("calm3", "e")
    assert step()[1] == {"flood", "calm", "calm2", "calm3"}


def test_no_first_token_step_when_every_tenant_runs_one_sequence():
    # Many users, a request each: a newcomer's prefill joins the running decodes.
    sched, add, step = _stack()
    add("a", "ta")
    add("b", "tb")
    for _ in range(3):
        step()
    add("c", "tc")
    assert step()[1] == {"a", "b", "c"}
    # Nor for a tenant that already runs something.
    add("flood", "f", n=4)
    step()
    step()
    add("flood-more", "f")
    _, ran = step()
    assert "flood-more" in ran and "a" in ran
