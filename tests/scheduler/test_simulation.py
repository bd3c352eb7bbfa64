"""2,000 requests through a pool small enough to force hundreds of preemptions, in swap and in
recompute mode: every request must end with exactly the tokens it gets on a huge pool.

The FakeExecutor derives each token from the context it reads back from its own KV pool
through the plan's block tables, so a wrong table, a missed copy-on-write or a bad swap
changes the tokens of the request it hits.
"""
from __future__ import annotations

import random

import pytest

from services.scheduler.config import SchedulerConfig
from tests.scheduler.simulation import make_requests, simulate

NUM_REQUESTS = 2000
REQUESTS = make_requests(NUM_REQUESTS, seed=7)
# 5 % of the requests are aborted 0..40 steps after they arrive: queued, prefilling,
# decoding, swapped out or already finished, whatever they are by then.
_rng = random.Random(8)
ABORTS = {req.request_id: _rng.randrange(0, 40) for _, req in REQUESTS if _rng.random() < 0.05}


def config(**kw) -> SchedulerConfig:
    # growth_reserve=0: admit as eagerly as vLLM v1 does, so the pool runs short often.
    return SchedulerConfig(block_size=4, max_num_seqs=64, max_num_batched_tokens=256,
                           max_model_len=128, growth_reserve=0.0, **kw)


@pytest.fixture(scope="module")
def reference():
    """The same requests on a pool that never runs short, without aborts."""
    run = simulate(REQUESTS, config(), num_gpu_blocks=20_000, num_cpu_blocks=0)
    assert run.num_preemptions == 0
    return run


@pytest.mark.parametrize("mode,policy", [("swap", "fcfs"), ("recompute", "fcfs"),
                                         ("auto", "priority")])
def test_preempted_requests_end_with_the_tokens_they_would_have_had(reference, mode, policy):
    # 90 blocks of 4 tokens; the CPU pool (60) is too small for some swaps: those recompute.
    run = simulate(REQUESTS, config(preemption_mode=mode, policy=policy), num_gpu_blocks=90,
                   num_cpu_blocks=60, aborts=ABORTS)
    assert run.num_preemptions >= 100
    if mode == "recompute":
        assert run.swapped_out_blocks == 0
    else:
        assert run.swapped_out_blocks > 0
    assert run.prefix_hits > 0
    num_aborted = 0
    for _, req in REQUESTS:
        rid = req.request_id
        want, got = reference.results[rid], run.results[rid]
        assert got.finished, rid
        aborted = any(s.finish_reason == "abort" for s in got.seqs.values())
        if aborted:
            num_aborted += 1
            assert rid in ABORTS
            if req.sampling.beam_width == 0:   # streamed tokens are a prefix of the full run
                for i, s in got.seqs.items():
                    assert s.token_ids == want.seqs[i].token_ids[:len(s.token_ids)], rid
            continue
        assert sorted(got.seqs) == sorted(want.seqs), rid
        for i, w in want.seqs.items():
            g = got.seqs[i]
            assert (g.token_ids, g.finish_reason, g.stop_token_id) == \
                   (w.token_ids, w.finish_reason, w.stop_token_id), (rid, i)
            assert g.logprobs == w.logprobs, (rid, i)
        assert got.prompt_logprobs == want.prompt_logprobs, rid
    assert num_aborted > 20
    st = run.scheduler.stats()
    assert (st.gpu_blocks_used, st.cpu_blocks_used, st.gpu_blocks_logical) == (0, 0, 0)
    assert not run.scheduler.has_unfinished()


def _rows(plan) -> dict:
    """A plan's rows by seq id, and what else it carries, in an order-free form."""
    rows = {sid: (c, t, tuple(app), keep, tuple(blocks), r < plan.num_sampling_rows)
            for r, (sid, c, t, app, keep, blocks) in enumerate(zip(
                plan.seq_ids, plan.num_computed_tokens, plan.num_tokens,
                plan.appended_per_row(), plan.block_keep, plan.block_append))}
    new = sorted((ns.seq_id, tuple(ns.token_ids), tuple(ns.block_table)) for ns in plan.new_seqs)
    moves = [sorted(map(tuple, pairs)) for pairs in (plan.copy, plan.swap_out, plan.swap_in)]
    return {"rows": rows, "new": new, "moves": moves,
            "finished": sorted(plan.finished_seq_ids)}


def _planned(requests, policy: str, num_gpu_blocks: int, aborts) -> tuple:
    """simulate() in "auto" preemption mode with 60 CPU blocks, and every plan's _rows."""
    from shared.messages import StepPlan
    plans = []

    def wire(msg):
        if isinstance(msg, StepPlan):
            plans.append(_rows(msg))
        return msg
    out = simulate(requests, config(preemption_mode="auto", policy=policy),
                   num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=60, aborts=aborts, wire=wire)
    return out, plans


def test_the_decode_pass_plans_what_the_general_path_plans(monkeypatch):
    """BlockManager.decode_slots and PlanBuilder.add_decodes (the bulk of a step) against the
    general path alone (_schedule_group, allocate_slots, add), over a run with hundreds of
    preemptions (swap and recompute), aborts, forks, beams and prefix hits: every step's plan
    holds the same rows (steady decodes come first, so the order differs), the same new
    sequences, copies, swaps and dropped ids, every request ends with the same tokens, and
    the prefix cache and the stats end the same."""
    from services.scheduler.block_manager import BlockManager

    def run():
        return _planned(REQUESTS[:600], "priority", 90, ABORTS)

    served = []
    real = BlockManager.decode_slots

    def counted(self, running, start, limit):
        seqs = real(self, running, start, limit)
        served.append(len(seqs))
        return seqs
    monkeypatch.setattr(BlockManager, "decode_slots", counted)
    fast, fast_plans = run()
    monkeypatch.setattr(BlockManager, "decode_slots", lambda self, running, start, limit: [])
    general, general_plans = run()
    assert fast.num_preemptions >= 50 and fast.swapped_out_blocks > 0
    rows = sum(len(p["rows"]) for p in fast_plans)
    assert rows > 10_000 and sum(served) > rows // 4     # a third of the rows: decode pass
    _assert_same_runs(fast, fast_plans, general, general_plans)


def _assert_same_runs(fast, fast_plans, general, general_plans) -> None:
    """The same plans step by step, the same tokens per request, the blocks the decodes
    filled in the prefix cache the same way, the same stats."""
    assert len(fast_plans) == len(general_plans)
    for step, (f, g) in enumerate(zip(fast_plans, general_plans)):
        assert f == g, step
    assert fast.results == general.results
    pools = [run.scheduler.block_manager.gpu for run in (fast, general)]
    assert pools[0].cached == pools[1].cached and pools[0].num_evictions == pools[1].num_evictions
    assert fast.scheduler.stats() == general.scheduler.stats()


PLAIN = [(t, r) for t, r in REQUESTS if r.sampling.n == 1 and r.sampling.beam_width == 0
         and r.sampling.logprobs is None and r.sampling.prompt_logprobs is None]


@pytest.mark.parametrize("plain,blocks,aborts,policy", [
    (False, 90, True, "priority"), (False, 20_000, False, "fcfs"),
    (True, 60, True, "priority"), (True, 20_000, False, "fcfs")])
def test_the_lead_plans_what_the_per_seq_path_plans(monkeypatch, plain, blocks, aborts, policy):
    """The running queue's lead (lead.py: steady decodes on columns) against the per-seq
    path alone: on a pool that forces preemptions (swap and recompute, aborts, forks, beams,
    prefix hits) and on one that never runs short, with every kind of request or only
    plain ones (the lead's), every step's plan holds the same rows, new sequences, copies,
    swaps and dropped ids, every request ends with the same tokens, logprobs and finish
    reasons, and the prefix cache and the stats end the same."""
    from services.scheduler.lead import Lead

    def run():
        return _planned(PLAIN if plain else REQUESTS[:600], policy, blocks,
                        ABORTS if aborts else None)

    led = []
    real = Lead.schedule

    def counted(self, step):
        k = real(self, step)
        led.append(k)
        return k
    monkeypatch.setattr(Lead, "schedule", counted)
    fast, fast_plans = run()
    monkeypatch.setattr(Lead, "extend", lambda self, running: None)
    general, general_plans = run()
    rows = sum(len(p["rows"]) for p in fast_plans)
    # the lead stops at the first group it cannot take (n > 1, beams, logprobs): with
    # every kind of request it runs a few rows in a hundred, with plain ones most of them
    assert rows > 5_000 and sum(led) > (rows // 2 if plain else rows // 50)
    _assert_same_runs(fast, fast_plans, general, general_plans)
