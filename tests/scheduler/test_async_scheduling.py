"""Async scheduling (services/scheduler/ahead.py): a step planned while the one before runs
decodes the token that step samples, which the executor fills in. Driven as the scheduler
service drives it (arrivals and aborts applied while the step planned ahead is in flight),
against the FakeExecutor, which reads every token back from its own KV pool through the
plans' block tables: a wrong position, table or placeholder changes the tokens."""
from __future__ import annotations

import random

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from shared.messages import GenerationRequest, SamplingParams, StepResult
from shared.wire import decode, encode
from tests.scheduler.fake_executor import VOCAB, FakeExecutor
from tests.scheduler.simulation import make_requests, simulate


def _bursts(num: int, seed: int) -> list[tuple[int, GenerationRequest]]:
    """One-sequence requests (the lead's kind) arriving in bursts of 20-60 with quiet
    stretches between, where every step can be planned ahead; half stop on token 0."""
    rng = random.Random(seed)
    out, step = [], 0
    while len(out) < num:
        for _ in range(rng.randint(20, 60)):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
            sp = SamplingParams(max_tokens=rng.randint(1, 60),
                                stop_token_ids=[0] if rng.random() < 0.5 else [],
                                min_tokens=rng.choice((0, 0, 3)))
            out.append((step, GenerationRequest(f"b{len(out)}", prompt, sp,
                                                priority=rng.choice((0, 1)))))
        step += rng.randint(30, 80)
    return out


BURSTS = _bursts(400, seed=3)
_rng = random.Random(4)
ABORTS = {r.request_id: _rng.randrange(0, 50) for _, r in BURSTS if _rng.random() < 0.08}


def config(**kw) -> SchedulerConfig:
    return SchedulerConfig(block_size=4, max_num_seqs=48, max_num_batched_tokens=256,
                           max_model_len=128, growth_reserve=0.0, **kw)


def _wire(msg):
    return decode(encode(msg))


def _assert_same_tokens(reference, run, requests, aborts) -> None:
    for _, req in requests:
        want, got = reference.results[req.request_id], run.results[req.request_id]
        assert got.finished, req.request_id
        for i, s in got.seqs.items():
            w = want.seqs[i]
            if s.finish_reason == "abort":
                assert req.request_id in aborts
                assert s.token_ids == w.token_ids[:len(s.token_ids)], req.request_id
            else:
                assert (s.token_ids, s.finish_reason, s.stop_token_id, s.logprobs) == (
                    w.token_ids, w.finish_reason, w.stop_token_id, w.logprobs), req.request_id


# (on the small pool requests wait for blocks most of the time: then nothing is planned ahead)
@pytest.mark.parametrize("blocks,aborts,policy,ahead_share", [
    (20_000, False, "fcfs", 0.5), (70, True, "priority", 0.02)])
def test_steps_planned_ahead_give_every_request_the_tokens_of_sync_scheduling(
        blocks, aborts, policy, ahead_share):
    """On a pool that never runs short, and on one that forces preemptions with aborts and
    priorities: every request ends with the tokens, logprobs and finish reason it gets when
    each step waits for the one before, with many steps planned ahead."""
    ab = ABORTS if aborts else None
    reference = simulate(BURSTS, config(), num_gpu_blocks=20_000, num_cpu_blocks=0)
    assert reference.scheduler.num_planned_ahead == 0
    run = simulate(BURSTS, config(policy=policy, preemption_mode="auto"), blocks, 40,
                   aborts=ab, wire=_wire, ahead=True)
    _assert_same_tokens(reference, run, BURSTS, ab or {})
    assert run.planned_ahead == run.scheduler.num_planned_ahead
    assert run.planned_ahead > ahead_share * run.steps, (run.planned_ahead, run.steps)
    if aborts:
        assert run.num_preemptions >= 20
    stats = run.scheduler.stats()
    # every block is back in the pool: none leaked by a row of a seq that had ended
    assert stats.gpu_blocks_used == 0 and stats.num_running == 0
    assert stats.generation_tokens_total >= sum(
        len(s.token_ids) for r in run.results.values() for s in r.seqs.values())


def test_blocks_filled_by_steps_planned_ahead_still_reach_the_prefix_cache():
    """The decode blocks a step planned ahead fills are registered once their last token is
    known: the same blocks as with sync scheduling end up in the prefix cache."""
    sync = simulate(BURSTS, config(), num_gpu_blocks=20_000, num_cpu_blocks=0)
    run = simulate(BURSTS, config(), num_gpu_blocks=20_000, num_cpu_blocks=0, ahead=True)
    assert run.planned_ahead > run.steps // 2

    def cached(r):       # the hash of every registered block: its tokens and its prefix's
        return sorted(r.scheduler.block_manager.gpu.cached)
    want = cached(sync)
    assert len(want) > 1000
    assert cached(run) == want


def test_mixed_requests_keep_their_tokens_and_plan_ahead_only_when_the_core_is_quiet():
    """Every kind of request (n > 1, beams, logprobs, prompt logprobs, a shared prefix) with
    aborts on a small pool, then bursts of one-sequence requests: the same tokens as sync
    scheduling. While the mixed ones run nothing is planned ahead (they are not the lead's);
    in the bursts' quiet stretches it is."""
    mixed = make_requests(150, seed=11)
    last = mixed[-1][0]
    requests = mixed + [(t + last + 100, r) for t, r in BURSTS[:150]]
    reference = simulate(requests, config(), num_gpu_blocks=20_000, num_cpu_blocks=0)
    aborts = {r.request_id: 5 for _, r in requests[::17]}
    only_mixed = simulate(mixed, config(), 90, 60, aborts=aborts, wire=_wire, ahead=True)
    assert only_mixed.planned_ahead == 0 and only_mixed.num_preemptions > 10
    run = simulate(requests, config(), 90, 60, aborts=aborts, wire=_wire, ahead=True)
    assert run.planned_ahead > 20      # (40: the small pool keeps requests waiting)
    _assert_same_tokens(reference, run, requests, aborts)


def _plain(rid: str, prompt: list[int], max_tokens: int, **kw) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw))


def _steady(n: int, max_tokens: int) -> tuple[Scheduler, FakeExecutor]:
    """n requests of one sequence, run until every one is decoding steadily."""
    sched = Scheduler(config(), 200, 0)
    ex = FakeExecutor(200, 0, 4)
    for i in range(n):
        sched.add_request(_plain(f"s{i}", [3, 1, 4, 1, 5], max_tokens))
    while True:
        plan = sched.schedule()
        sched.update(plan, ex.execute(plan))
        if all(g.first_output_sent for g in sched.running):
            return sched, ex


def test_a_step_is_planned_ahead_only_when_its_result_is_not_needed():
    sched, ex = _steady(3, 30)
    plan = sched.schedule()
    ahead = sched.schedule_ahead()
    assert ahead is not None and ahead.step_id == plan.step_id + 1
    assert ahead.seq_ids == plan.seq_ids and ahead.append_token_ids == [-1] * 3
    assert ahead.num_computed_tokens == [c + 1 for c in plan.num_computed_tokens]
    assert sched.schedule_ahead() is None          # two in flight at most
    with pytest.raises(RuntimeError):
        sched.schedule()
    result = ex.execute(plan)
    with pytest.raises(ValueError):                # results apply in plan order
        sched.update(ahead, result)
    sched.update(plan, result)
    sched.update(ahead, ex.execute(ahead))
    # a request arrives: its prefill rides in the next step, which needs that result
    sched.add_request(_plain("late", [7, 8, 9], 5))
    plan = sched.schedule()
    assert len(plan.new_seqs) == 1 and sched.schedule_ahead() is None
    sched.update(plan, ex.execute(plan))
    plan = sched.schedule()                        # four steady decodes again
    assert len(plan.seq_ids) == 4 and not plan.new_seqs
    ahead = sched.schedule_ahead()
    assert ahead is not None and ahead.append_token_ids == [-1] * 4
    sched.update(plan, ex.execute(plan))
    sched.update(ahead, ex.execute(ahead))


def test_a_failed_step_fails_the_step_planned_ahead_of_it_without_a_trace():
    """A step fails while the one planned ahead of it is in flight: its requests end with
    the error, the ahead step's rows (the same seqs) are skipped, and every block is freed."""
    sched, ex = _steady(4, 40)
    plan = sched.schedule()
    ahead = sched.schedule_ahead()
    assert ahead is not None
    news = sched.update(plan, StepResult(plan.step_id, error="device lost"))
    failed = news.request_outputs()
    assert len(failed) == 4 and all(o.error_code == 500 and o.finished for o in failed)
    out = sched.update(ahead, StepResult(ahead.step_id, token_ids=[9] * 4,
                                         logprobs=[-1.0] * 4))
    assert len(out) == 0 and not sched.has_unfinished()
    assert sched.stats().gpu_blocks_used == 0
