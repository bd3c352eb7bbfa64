"""Scheduler behaviours against the FakeExecutor (which keeps the plan contract to the letter)."""
from __future__ import annotations

from collections import namedtuple

import pytest

from services.scheduler.beam_search import beam_score
from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import AdmissionError, Scheduler
from shared.messages import GenerationRequest, SamplingParams, StepResult
from tests.scheduler.fake_executor import FakeExecutor, candidates, next_token, prompt_logprob

BS = 4

Row = namedtuple("Row", "seq_id num_computed_tokens num_tokens append_token_ids block_keep "
                        "block_append")


def rows(plan) -> list[Row]:
    """The plan's rows, one record each (the plan itself is columnar)."""
    return [Row(*r) for r in zip(plan.seq_ids, plan.num_computed_tokens, plan.num_tokens,
                                 plan.appended_per_row(), plan.block_keep, plan.block_append)]


class Engine:
    """A Scheduler and a FakeExecutor stepping together."""

    def __init__(self, gpu=64, cpu=32, script=None, **cfg):
        base = dict(block_size=BS, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256)
        base.update(cfg)
        self.config = SchedulerConfig(**base)
        self.sched = Scheduler(self.config, gpu, cpu)
        self.ex = FakeExecutor(gpu, cpu, BS, script=script)
        self.plans = []
        self.outputs: dict[str, list] = {}

    def add(self, rid, prompt, priority=0, **sp):
        prompt = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
        self.sched.add_request(GenerationRequest(rid, prompt, SamplingParams(**sp),
                                                 priority=priority,
                                                 arrival_time=float(len(self.outputs))))
        self.outputs.setdefault(rid, [])

    def step(self):
        plan = self.sched.schedule()
        if plan is None:
            return None, []
        self.plans.append(plan)
        outs = self.sched.update(plan, self.ex.execute(plan)).request_outputs()
        for o in outs:
            self.outputs.setdefault(o.request_id, []).append(o)
        return plan, outs

    def run(self, max_steps=10_000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("did not finish")

    def tokens(self, rid, index=0):
        return [t for o in self.outputs[rid] for d in o.seqs if d.index == index
                for t in d.token_ids]

    def final(self, rid):
        return self.outputs[rid][-1]


def greedy_tokens(prompt, n, sample_index=0):
    """What the fake model produces for a prompt, token by token."""
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(tuple(toks), sample_index)[0])
    return toks[len(prompt):]


# ---------------------------------------------------------------- admission


def test_a_prompt_longer_than_the_context_is_refused_with_what_to_do():
    e = Engine(max_model_len=32)
    with pytest.raises(AdmissionError) as err:
        e.add("a", 30, max_tokens=5)
    assert "exceeds the context length of 32" in str(err.value)
    assert "lower max_tokens" in str(err.value)
    assert not e.sched.has_unfinished()


def test_a_request_that_cannot_fit_an_empty_pool_is_refused():
    e = Engine(gpu=4)          # 16 token slots
    with pytest.raises(AdmissionError) as err:
        e.add("a", 10, max_tokens=10)
    assert "KV blocks" in str(err.value) and "pool has only 4" in str(err.value)
    e.add("b", 6, max_tokens=10)          # exactly 4 blocks: accepted, and it runs
    e.run()
    assert e.final("b").seqs[0].finish_reason == "length"


def test_n_above_what_one_step_can_batch_is_refused():
    e = Engine(max_num_seqs=4)
    with pytest.raises(AdmissionError):
        e.add("a", 5, n=5)
    with pytest.raises(AdmissionError):
        e.add("b", 5, beam_width=2, n=3)


# ---------------------------------------------------------------- batching and plans


def test_decodes_and_prefill_chunks_share_a_step():
    e = Engine(max_num_batched_tokens=16)
    e.add("a", 8, max_tokens=20)
    plan, outs = e.step()
    assert [(s.num_computed_tokens, s.num_tokens) for s in rows(plan)] == [(0, 8)]
    assert len(outs) == 1                 # the whole prompt ran: a token was sampled
    e.add("b", list(range(100, 140)), max_tokens=4)
    plan, outs = e.step()
    a_id, b_id = [ns.seq_id for ns in e.plans[0].new_seqs][0], plan.new_seqs[0].seq_id
    work = {s.seq_id: (s.num_computed_tokens, s.num_tokens) for s in rows(plan)}
    assert work == {a_id: (8, 1), b_id: (0, 15)}     # a decode and a 15-token chunk
    assert [o.request_id for o in outs] == ["a"]     # b's chunk did not reach its end
    plan, outs = e.step()
    assert {s.seq_id: s.num_tokens for s in rows(plan)} == {a_id: 1, b_id: 15}
    plan, outs = e.step()
    assert {s.seq_id: s.num_tokens for s in rows(plan)} == {a_id: 1, b_id: 10}
    assert sorted(o.request_id for o in outs) == ["a", "b"]


def test_known_sequences_get_diffs_not_their_whole_state():
    e = Engine()
    e.add("a", 6, max_tokens=10)
    plan, outs = e.step()
    assert len(plan.new_seqs) == 1 and len(plan.new_seqs[0].block_table) == 2
    first = outs[0].seqs[0].token_ids
    plan, outs = e.step()                 # position 6: inside block 1, no new block
    (s,) = rows(plan)
    assert plan.new_seqs == [] and s.append_token_ids == first
    assert (s.block_keep, s.block_append) == (-1, [])
    assert (s.num_computed_tokens, s.num_tokens) == (6, 1)
    plan, outs = e.step()                 # position 7 fills block 1
    plan, outs = e.step()                 # position 8 needs block 2
    (s,) = rows(plan)
    assert s.block_keep == -1 and len(s.block_append) == 1 and len(s.append_token_ids) == 1


def test_schedule_returns_none_when_there_is_nothing_to_run():
    e = Engine()
    assert e.sched.schedule() is None
    e.add("a", 3, max_tokens=2)
    e.run()
    assert e.sched.schedule() is None
    assert e.sched.stats().gpu_blocks_used == 0


def test_fcfs_admits_in_arrival_order():
    e = Engine(max_num_seqs=1)
    e.add("first", 4, max_tokens=2, priority=5)
    e.add("second", 4, max_tokens=2, priority=0)
    plan, _ = e.step()
    assert plan.new_seqs[0].request_id == "first"


def test_priority_policy_admits_lower_values_first():
    e = Engine(max_num_seqs=1, policy="priority")
    e.add("low", 4, max_tokens=2, priority=5)
    e.add("high", 4, max_tokens=2, priority=0)
    plan, _ = e.step()
    assert plan.new_seqs[0].request_id == "high"
    e.run()
    assert e.final("low").finished


def _run_until_admitted(e, rid):
    """Step until `rid` appears in a plan's new seqs; that plan."""
    for _ in range(100):
        plan, _ = e.step()
        if any(ns.request_id == rid for ns in plan.new_seqs):
            return plan
    raise AssertionError(f"{rid} was never admitted")


@pytest.mark.parametrize("limit", ["seats", "blocks"])
def test_priority_policy_preempts_less_important_running_work_for_an_arrival(limit):
    # seats: one sequence at a time; blocks: 8 blocks of 4, "low" holds 5 by the time
    # "high" (3 blocks for its prompt, 4 with its growth reserve) arrives.
    cfg = dict(max_num_seqs=1) if limit == "seats" else dict(gpu=8, watermark=0.0)
    e = Engine(policy="priority", preemption_mode="swap", **cfg)
    e.add("low", list(range(1, 13)), max_tokens=20, priority=5)
    for _ in range(8):
        e.step()
    assert e.tokens("low"), "low should be decoding"
    low_seq = e.plans[0].new_seqs[0].seq_id
    e.add("high", list(range(60, 71)), max_tokens=4, priority=0)
    plan = _run_until_admitted(e, "high")
    assert plan is e.plans[-1] and len(e.plans) == 9     # admitted in the very next step
    assert low_seq in plan.finished_seq_ids               # by recompute, whatever the mode
    assert not plan.swap_out and low_seq not in [ns.seq_id for ns in plan.new_seqs]
    assert e.sched.stats().num_preemptions == 1
    e.run()
    assert e.tokens("high") == greedy_tokens(range(60, 71), 4)
    assert e.tokens("low") == greedy_tokens(range(1, 13), 20)     # resumed exactly
    assert e.sched.stats().gpu_blocks_used == 0


@pytest.mark.parametrize("policy,priority", [("fcfs", 0), ("priority", 5)])
def test_an_arrival_of_no_higher_priority_waits_for_running_work(policy, priority):
    e = Engine(max_num_seqs=1, policy=policy)
    e.add("first", list(range(1, 13)), max_tokens=10, priority=5)
    e.step()
    e.add("second", list(range(60, 71)), max_tokens=4, priority=priority)
    while not (e.outputs["first"] and e.final("first").finished):
        plan, _ = e.step()
        assert not plan.finished_seq_ids
        assert not any(ns.request_id == "second" for ns in plan.new_seqs)
    e.run()
    assert e.tokens("second") == greedy_tokens(range(60, 71), 4)
    assert e.sched.stats().num_preemptions == 0


def test_priority_preemption_leaves_running_work_alone_when_it_would_not_make_room():
    # "big" needs more blocks than "low" frees: preempting low would gain nothing.
    e = Engine(gpu=8, policy="priority", watermark=0.0, max_model_len=64)
    e.add("low", list(range(1, 9)), max_tokens=4, priority=5)
    e.add("mid", list(range(20, 28)), max_tokens=4, priority=0)
    e.step()
    e.add("big", list(range(40, 69)), max_tokens=2, priority=0)   # 8 blocks: the whole pool
    plan, _ = e.step()
    assert not plan.finished_seq_ids
    e.run()
    assert e.tokens("big") == greedy_tokens(range(40, 69), 2)


# ---------------------------------------------------------------- preemption


def test_block_shortage_preempts_the_latest_arrival_and_recomputes_it_whole():
    # 6 blocks of 4: a and b each need 3 at their end, the last block of each needs room.
    # 5 blocks of 4: a and b need 3 each by their end; the prompts share nothing.
    e = Engine(gpu=5, preemption_mode="recompute", watermark=0.0, growth_reserve=0.0)
    e.add("a", list(range(1, 8)), max_tokens=6)
    e.add("b", list(range(50, 57)), max_tokens=6)
    preempted_plan = None
    while e.sched.has_unfinished():
        plan, _ = e.step()
        if plan.finished_seq_ids and preempted_plan is None:
            preempted_plan = plan
    assert e.sched.stats().num_preemptions >= 1
    b_seq = next(ns.seq_id for p in e.plans for ns in p.new_seqs if ns.request_id == "b")
    assert b_seq in preempted_plan.finished_seq_ids
    back = [ns for p in e.plans[e.plans.index(preempted_plan) + 1:] for ns in p.new_seqs
            if ns.seq_id == b_seq]
    assert back and back[0].prompt_len == 7 and len(back[0].token_ids) > 7   # prompt + outputs
    assert e.tokens("a") == greedy_tokens(range(1, 8), 6)
    assert e.tokens("b") == greedy_tokens(range(50, 57), 6)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_auto_mode_swaps_a_group_of_several_seqs_and_resumes_it_before_admitting(policy):
    # 10 blocks: single needs 5 by its end, the group 1 shared + 4 + 4. Under the priority
    # policy "late" outranks both, and still waits for the swapped group (nor preempts).
    e = Engine(gpu=10, cpu=16, preemption_mode="auto", watermark=0.0, growth_reserve=0.0,
               policy=policy)
    e.add("single", list(range(1, 9)), max_tokens=12)
    e.add("group", list(range(50, 55)), max_tokens=16, n=2)
    swapped_out = []
    while not swapped_out and e.sched.has_unfinished():
        plan, _ = e.step()
        swapped_out = plan.swap_out
    assert swapped_out
    assert e.sched.stats().num_swapped == 1
    e.add("late", 3, max_tokens=2, priority=-1)
    seen_swap_in = False
    while e.sched.has_unfinished():
        plan, _ = e.step()
        seen_swap_in |= bool(plan.swap_in)
        if any(ns.request_id == "late" for ns in plan.new_seqs):
            assert seen_swap_in, "a new request was admitted while a group was swapped out"
    assert e.sched.stats().swapped_in_blocks_total == e.sched.stats().swapped_out_blocks_total
    for i in range(2):
        assert e.tokens("group", i) == greedy_tokens(range(50, 55), 16, i)
    assert e.tokens("single") == greedy_tokens(range(1, 9), 12)


def test_many_requests_each_needing_most_of_the_pool_all_finish():
    e = Engine(gpu=8, preemption_mode="recompute")
    for i in range(6):
        e.add(f"r{i}", 9, max_tokens=20)     # 8 blocks at their end: the whole pool
    e.run()
    for i in range(6):
        assert e.tokens(f"r{i}") == greedy_tokens(range(1, 10), 20)
    assert e.sched.stats().gpu_blocks_used == 0


# ---------------------------------------------------------------- finishing


def test_a_stop_token_finishes_the_sequence_and_is_not_reported_as_output():
    expected = greedy_tokens(range(1, 6), 8)
    stop = expected[3]
    cut = expected.index(stop)
    e = Engine()
    e.add("a", 5, max_tokens=8, stop_token_ids=[stop])
    e.run()
    last = e.final("a").seqs[-1]
    assert (last.finish_reason, last.stop_token_id) == ("stop", stop)
    assert e.tokens("a") == expected[:cut]
    assert e.final("a").finished


def test_stop_tokens_are_ignored_before_min_tokens():
    e = Engine(script={"a": [7, 7, 7, 3, 7, 9]})
    e.add("a", 5, max_tokens=6, stop_token_ids=[7], min_tokens=3)
    e.run()
    assert e.tokens("a") == [7, 7, 7, 3]
    assert e.final("a").seqs[-1].stop_token_id == 7


def test_max_tokens_finishes_with_length():
    e = Engine()
    e.add("a", 5, max_tokens=3)
    e.run()
    assert len(e.tokens("a")) == 3
    assert e.final("a").seqs[-1].finish_reason == "length" and e.final("a").finished
    st = e.sched.stats()
    assert (st.prompt_tokens_total, st.generation_tokens_total) == (5, 3)


def test_logprobs_come_with_every_token():
    e = Engine()
    e.add("a", 5, max_tokens=4, logprobs=2)
    e.run()
    deltas = [d for o in e.outputs["a"] for d in o.seqs]
    ctx = list(range(1, 6))
    for d in deltas:
        (lp,) = d.logprobs
        assert lp.token_id == d.token_ids[0]
        assert lp.logprob == next_token(tuple(ctx), 0)[1]
        assert lp.top == candidates(tuple(ctx), 2)
        ctx.append(d.token_ids[0])
    total = sum(d.logprobs[0].logprob for d in deltas)
    assert deltas[-1].cumulative_logprob == pytest.approx(total)


def test_prompt_logprobs_are_gathered_across_chunks_into_the_first_output():
    e = Engine(max_num_batched_tokens=8)
    prompt = list(range(3, 23))
    e.add("a", prompt, max_tokens=3, prompt_logprobs=1)
    e.run()
    first, rest = e.outputs["a"][0], e.outputs["a"][1:]
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(prompt)
    for p, lp in enumerate(first.prompt_logprobs[1:], start=1):
        assert (lp.token_id, lp.logprob) == (prompt[p], prompt_logprob(tuple(prompt[:p + 1])))
    assert all(o.prompt_logprobs is None for o in rest)


def test_a_repeated_prompt_is_served_from_the_prefix_cache():
    e = Engine()
    prompt = list(range(10, 30))
    e.add("a", prompt, max_tokens=2)
    e.run()
    e.add("b", prompt, max_tokens=2)
    e.run()
    # 19 of 20 tokens may come from the cache (the last one runs): 4 whole blocks
    assert e.outputs["b"][0].num_cached_tokens == 16 and e.outputs["a"][0].num_cached_tokens == 0
    st = e.sched.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (40, 16)
    assert e.tokens("a") == e.tokens("b")


def test_identical_prompts_admitted_in_one_step_share_the_blocks_it_computes():
    e = Engine()
    prompt = list(range(10, 30))                  # 5 blocks of 4
    e.add("a", prompt, max_tokens=3)
    e.add("b", prompt, max_tokens=3)
    plan, _ = e.step()
    # Both start in the first step: a computes the prompt, b maps a's 4 whole blocks (its last
    # token must run) and computes only from position 16, reading what a writes in this step.
    assert [(s.num_computed_tokens, s.num_tokens) for s in rows(plan)] == [(0, 20), (16, 4)]
    a, b = plan.new_seqs
    assert b.block_table[:4] == a.block_table[:4] and b.block_table[4] != a.block_table[4]
    assert e.sched.stats().gpu_blocks_used == 6
    e.run()
    assert e.outputs["b"][0].num_cached_tokens == 16
    assert e.tokens("a") == e.tokens("b") == greedy_tokens(prompt, 3)


def test_a_failed_step_takes_back_the_prefix_blocks_it_registered():
    e = Engine()
    prompt = list(range(10, 30))
    e.add("a", prompt, max_tokens=3)
    plan = e.sched.schedule()
    e.ex.execute(plan)                      # the executors know seq a; the step then fails
    (out,) = e.sched.update(plan, StepResult(plan.step_id, error="device lost")).outputs
    assert out.error_code == 500 and e.sched.stats().gpu_blocks_cached == 0
    e.add("b", prompt, max_tokens=3)         # must compute its prompt: nothing was written
    e.run()
    assert e.outputs["b"][0].num_cached_tokens == 0
    assert e.tokens("b") == greedy_tokens(prompt, 3)


def test_an_abort_while_a_step_runs_takes_back_the_prefix_blocks_it_registered():
    e = Engine()
    prompt = list(range(10, 30))
    e.add("a", prompt, max_tokens=3)
    plan = e.sched.schedule()
    e.ex.execute(plan)
    e.sched.abort_request("a")
    assert e.sched.stats().gpu_blocks_cached == 0
    e.sched.update(plan, StepResult(plan.step_id, error="device lost"))
    e.add("b", prompt, max_tokens=3)
    e.run()
    assert e.outputs["b"][0].num_cached_tokens == 0 and e.tokens("b") == greedy_tokens(prompt, 3)


# ---------------------------------------------------------------- sharing


def test_parallel_sampling_stores_the_prompt_once():
    e = Engine(gpu=64)
    e.add("a", 33, max_tokens=6, n=4)           # fork point 32 = 8 full blocks
    plan, outs = e.step()
    assert outs == [] and [s.num_tokens for s in rows(plan)] == [32]
    plan, outs = e.step()
    assert sorted(ns.sample_index for ns in plan.new_seqs) == [1, 2, 3]
    assert all(s.num_computed_tokens == 32 and s.num_tokens == 1 for s in rows(plan))
    assert e.sched.stats().gpu_blocks_used == 8 + 4          # shared prompt + one block each
    assert e.sched.stats().gpu_blocks_logical == 4 * 9
    e.run()
    for i in range(4):
        assert e.tokens("a", i) == greedy_tokens(range(1, 34), 6, i)


def test_parallel_sampling_copies_the_shared_partial_block_on_write():
    e = Engine()
    e.add("a", 31, max_tokens=3, n=3)           # fork point 30: block 7 holds 2 tokens
    e.step()
    plan, _ = e.step()
    assert len(plan.copy) == 2                   # n - 1 copies; the last writer keeps it
    assert len({src for src, _ in plan.copy}) == 1
    e.run()
    for i in range(3):
        assert e.tokens("a", i) == greedy_tokens(range(1, 32), 3, i)


def reference_beam_search(prompt, k, n, max_tokens, length_penalty=1.0, stop=(), min_tokens=0):
    """Plain beam search over the fake model, no blocks: what the scheduler must reproduce."""
    L = len(prompt)
    beams = [(list(prompt), 0.0)]
    done = []
    max_len = L + max_tokens

    def hyp(tokens, cum, reason, stop_tok=None):
        return (beam_score(cum, len(tokens), length_penalty), tokens[L:], reason, stop_tok)

    for _ in range(max_tokens):
        cands = sorted(((cum + lp, toks, tok) for toks, cum in beams
                        for tok, lp in candidates(tuple(toks), 2 * k)), key=lambda c: -c[0])
        nxt = []
        for cum, toks, tok in cands:
            if tok in stop:
                if len(toks) - L >= min_tokens:
                    done.append(hyp(toks, cum, "stop", tok))
            elif len(nxt) < k:
                nxt.append((toks + [tok], cum))
        done = sorted(done, key=lambda h: -h[0])[:k]
        if not nxt:
            break
        if len(nxt[0][0]) >= max_len:
            done = sorted(done + [hyp(t, c, "length") for t, c in nxt], key=lambda h: -h[0])[:k]
            break
        best = nxt[0][1] / ((max_len if length_penalty > 0 else len(nxt[0][0])) ** length_penalty)
        if len(done) >= k and done[k - 1][0] >= best:
            break
        beams = nxt
    return done[:n]


@pytest.mark.parametrize("k,n,lp,stop", [(2, 2, 1.0, ()), (3, 2, 0.5, (5, 17)), (4, 3, 0.0, (9,))])
def test_beam_search_returns_the_best_beams_of_a_reference_search(k, n, lp, stop):
    prompt = [11, 12, 13, 14, 15, 16]
    e = Engine(gpu=128)
    e.add("a", prompt, max_tokens=10, beam_width=k, n=n, length_penalty=lp,
          stop_token_ids=list(stop))
    e.run()
    assert len(e.outputs["a"]) == 1              # beams report only when finished
    out = e.final("a")
    want = reference_beam_search(prompt, k, n, 10, lp, stop)
    got = [(d.token_ids, d.finish_reason, d.stop_token_id) for d in out.seqs]
    assert got == [(t, r, s) for _, t, r, s in want]
    assert [d.index for d in out.seqs] == list(range(len(want)))
    assert e.sched.stats().gpu_blocks_used == 0


def test_beams_share_blocks():
    e = Engine(gpu=128)
    e.add("a", 17, max_tokens=12, beam_width=4)
    peak = 0
    while e.sched.has_unfinished():
        e.step()
        st = e.sched.stats()
        peak = max(peak, st.gpu_blocks_logical - st.gpu_blocks_used)
    assert peak >= 4 * 4 - 4          # at least the 4-block prompt is held once, not 4 times


# ---------------------------------------------------------------- aborts and failures


def test_an_abort_frees_everything_whatever_state_the_request_is_in():
    e = Engine(gpu=24, cpu=16, max_num_batched_tokens=16, preemption_mode="swap", watermark=0.0,
               growth_reserve=0.0)
    e.add("decoding", list(range(1, 7)), max_tokens=30)
    e.add("group", list(range(20, 29)), max_tokens=20, n=2)
    e.add("beam", list(range(40, 47)), max_tokens=12, beam_width=2)
    e.add("long", list(range(60, 100)), max_tokens=4)
    e.add("short", list(range(100, 120)), max_tokens=4)
    for _ in range(6):
        e.step()
    e.add("queued", 30, max_tokens=4)
    e.step()
    states = {g.request_id: g.status.name for g in e.sched.groups.values()}
    assert {"RUNNING", "SWAPPED", "WAITING"} <= set(states.values()), states
    known = {ns.seq_id for p in e.plans for ns in p.new_seqs}
    for rid in ["group", "decoding", "short", "beam", "queued", "long"]:
        out = e.sched.abort_request(rid)
        assert out.finished and out.seqs and all(d.finish_reason == "abort" for d in out.seqs)
    assert e.sched.abort_request("decoding") is None
    st = e.sched.stats()
    assert (st.gpu_blocks_used, st.cpu_blocks_used, st.gpu_blocks_logical) == (0, 0, 0)
    assert not e.sched.has_unfinished()
    # The executors are told to drop every seq they know, with the next plan.
    e.add("next", 3, max_tokens=1)
    plan, _ = e.step()
    dropped_before = {s for p in e.plans[:-1] for s in p.finished_seq_ids}
    assert known == dropped_before | set(plan.finished_seq_ids)
    e.run()


def test_an_executor_error_fails_the_requests_of_the_step():
    e = Engine()
    e.add("a", 5, max_tokens=5, n=2)
    plan = e.sched.schedule()
    outs = e.sched.update(plan, StepResult(plan.step_id, error="CUDA out of memory")).outputs
    assert len(outs) == 1 and outs[0].error_code == 500 and "CUDA out of memory" in outs[0].error
    assert outs[0].finished and not e.sched.has_unfinished()
    assert e.sched.stats().gpu_blocks_used == 0


def test_contiguous_baseline_reserves_max_model_len_for_each_sequence():
    e = Engine(contiguous=True, max_model_len=64)   # 16 blocks per seq
    e.add("a", 5, max_tokens=3, n=2)
    e.step()
    assert e.sched.stats().gpu_blocks_used == 16
    e.step()
    assert e.sched.stats().gpu_blocks_used == 32    # the fork copied, nothing is shared
    e.run()
    for i in range(2):
        assert e.tokens("a", i) == greedy_tokens(range(1, 6), 3, i)
    with pytest.raises(AdmissionError):
        e.add("b", 5, max_tokens=3, beam_width=2)


def test_a_result_without_a_token_for_every_sampling_row_fails_the_step():
    e = Engine()
    e.add("a", 5, max_tokens=5)
    plan = e.sched.schedule()
    (out,) = e.sched.update(plan, StepResult(plan.step_id)).outputs
    assert out.error_code == 500 and "returned 0 tokens" in out.error and out.finished
    assert not e.sched.has_unfinished() and e.sched.stats().gpu_blocks_used == 0


def test_a_redelivered_request_is_not_queued_twice():
    e = Engine()
    e.add("a", 5, max_tokens=3)
    e.add("a", 5, max_tokens=3)
    assert e.sched.stats().num_waiting == 1
    e.run()
    assert len(e.tokens("a")) == 3


def test_a_swapped_group_that_needs_the_whole_pool_comes_back():
    # The group alone needs all 9 blocks by its end (1 shared + 2 x 4 private).
    e = Engine(gpu=9, cpu=16, preemption_mode="swap", watermark=0.0, growth_reserve=0.0)
    e.add("single", list(range(60, 67)), max_tokens=14)
    e.add("group", list(range(1, 6)), max_tokens=16, n=2)
    e.run(max_steps=500)
    assert e.sched.stats().num_preemptions >= 1 and e.sched.stats().swapped_in_blocks_total
    for i in range(2):
        assert e.tokens("group", i) == greedy_tokens(range(1, 6), 16, i)


def test_an_abort_while_a_plan_is_in_flight_drops_its_results():
    e = Engine()
    e.add("a", 5, max_tokens=5)
    e.add("b", 6, max_tokens=5)
    plan = e.sched.schedule()
    a_id = next(ns.seq_id for ns in plan.new_seqs if ns.request_id == "a")
    result = e.ex.execute(plan)
    assert e.sched.abort_request("a").finished
    outs = e.sched.update(plan, result).request_outputs()
    assert [o.request_id for o in outs] == ["b"]
    plan, _ = e.step()
    assert plan.finished_seq_ids == [a_id] and a_id not in plan.seq_ids
    assert len(rows(plan)) == 1
    e.run()
    assert e.sched.stats().gpu_blocks_used == 0


@pytest.mark.parametrize("in_flight", [False, True])
def test_aborting_one_sequence_of_n_frees_it_and_the_others_go_on(in_flight):
    e = Engine(preemption_mode="recompute")
    e.add("a", 9, max_tokens=12, n=3)
    while len(e.tokens("a", 1)) < 3:
        e.step()
    seq_ids = {ns.sample_index: ns.seq_id for p in e.plans for ns in p.new_seqs}
    used = e.sched.stats().gpu_blocks_used
    if in_flight:
        plan = e.sched.schedule()
        result = e.ex.execute(plan)
    out = e.sched.abort_seq("a", 1, "stop_string")
    assert [(d.index, d.finish_reason) for d in out.seqs] == [(1, "stop_string")]
    assert not out.finished
    assert e.sched.abort_seq("a", 1) is None                  # already stopped
    if in_flight:
        outs = e.sched.update(plan, result).request_outputs()
        assert all(d.index != 1 for o in outs for d in o.seqs)    # its sample is dropped
        e.outputs["a"] += outs
    assert e.sched.stats().gpu_blocks_used < used                # its own blocks are free
    plan, _ = e.step()
    assert seq_ids[1] in plan.finished_seq_ids
    assert {s.seq_id for s in rows(plan)} == {seq_ids[0], seq_ids[2]}
    stopped_at = len(e.tokens("a", 1))
    e.run()
    assert len(e.tokens("a", 1)) == stopped_at
    for i in (0, 2):
        assert e.tokens("a", i) == greedy_tokens(range(1, 10), 12, i)
    assert e.final("a").finished and e.sched.stats().gpu_blocks_used == 0


def test_aborting_the_last_running_sequence_of_n_ends_the_request():
    e = Engine()
    e.add("a", 9, max_tokens=30, n=2)
    while len(e.tokens("a", 0)) < 2:
        e.step()
    assert not e.sched.abort_seq("a", 0, "stop_string").finished
    out = e.sched.abort_seq("a", 1, "stop_string")
    assert out.finished and not e.sched.has_unfinished()
    assert e.sched.stats().gpu_blocks_used == 0
    assert e.sched.abort_seq("a", 1) is None and e.sched.abort_seq("nope", 0) is None


def test_the_engine_core_never_imports_torch():
    """The wall (docs/design.md): the scheduler's image has no torch. numpy it may use (the
    running queue's lead keeps columns, lead.py)."""
    import subprocess
    import sys
    code = ("import sys, services.scheduler.scheduler, services.scheduler.block_manager, "
            "services.scheduler.beam_search; "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.stdout.strip() == "[]"
