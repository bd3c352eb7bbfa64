"""Drives the real Scheduler against the FakeExecutor over a seeded stream of requests."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from shared.messages import GenerationRequest, RequestOutput, SamplingParams
from tests.scheduler.fake_executor import VOCAB, FakeExecutor


@dataclass
class SeqResult:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_token_id: int | None = None


@dataclass
class RequestResult:
    seqs: dict[int, SeqResult] = field(default_factory=dict)
    finished: bool = False
    num_outputs: int = 0
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0


@dataclass
class SimRun:
    results: dict[str, RequestResult]
    steps: int
    num_preemptions: int
    swapped_out_blocks: int
    prefix_hits: int
    scheduler: Scheduler
    planned_ahead: int = 0       # plans made while the plan before them ran (ahead.py)


def make_requests(num: int, seed: int, max_prompt: int = 48, max_new: int = 24,
                  shared_prefix: int = 12) -> list[tuple[int, GenerationRequest]]:
    """(arrival step, request): random prompt and output lengths, n in 1..3, beams of 2..3,
    stop tokens, logprobs; a quarter of the prompts start with a common prefix (cache hits)."""
    rng = random.Random(seed)
    common = [rng.randrange(VOCAB) for _ in range(shared_prefix)]
    out, step = [], 0
    for i in range(num):
        step += rng.choice((0, 0, 1, 1, 2))
        plen = rng.randint(1, max_prompt)
        prompt = [rng.randrange(VOCAB) for _ in range(plen)]
        if rng.random() < 0.25:
            prompt = (common + prompt)[:max(plen, shared_prefix + 1)]
        kind = rng.random()
        sp = SamplingParams(max_tokens=rng.randint(1, max_new),
                            stop_token_ids=[0] if rng.random() < 0.5 else [],
                            min_tokens=rng.choice((0, 0, 2)))
        if kind < 0.15:
            sp.beam_width = rng.choice((2, 3))
            sp.n = rng.randint(1, sp.beam_width)
            sp.length_penalty = rng.choice((1.0, 0.5, 0.0))
        elif kind < 0.40:
            sp.n = rng.choice((2, 3))
        if rng.random() < 0.1:
            sp.logprobs = rng.choice((0, 2))
        if rng.random() < 0.05:
            sp.prompt_logprobs = 1
        out.append((step, GenerationRequest(f"r{i}", prompt, sp,
                                            priority=rng.choice((0, 0, 1)),
                                            arrival_time=float(i))))
    return out


def _collect(results: dict[str, RequestResult], outputs: list[RequestOutput]) -> None:
    for out in outputs:
        r = results.setdefault(out.request_id, RequestResult())
        if r.finished:
            raise AssertionError(f"{out.request_id}: output after its final one")
        if r.num_outputs == 0:
            r.prompt_logprobs = out.prompt_logprobs
            r.num_cached_tokens = out.num_cached_tokens
        elif out.prompt_logprobs is not None:
            raise AssertionError(f"{out.request_id}: prompt logprobs outside the first output")
        r.num_outputs += 1
        for d in out.seqs:
            s = r.seqs.setdefault(d.index, SeqResult())
            if s.finish_reason is not None:
                raise AssertionError(f"{out.request_id}[{d.index}]: tokens after finishing")
            s.token_ids.extend(d.token_ids)
            s.logprobs.extend((lp.token_id, lp.logprob) for lp in d.logprobs)
            s.finish_reason = d.finish_reason
            s.stop_token_id = d.stop_token_id
        r.finished = out.finished


def simulate(requests: list[tuple[int, GenerationRequest]], config: SchedulerConfig,
             num_gpu_blocks: int, num_cpu_blocks: int, aborts: dict[str, int] | None = None,
             max_steps: int = 1_000_000, wire: Callable[[Any], Any] | None = None,
             ahead: bool = False) -> SimRun:
    """Run every request to the end. `aborts`: request id -> steps after its arrival at which
    the driver aborts it (whatever state it is in then). `wire`: applied to every plan,
    result and output on its way, as a process boundary would (e.g. an encode/decode).
    `ahead`: async scheduling as the scheduler service does it: after a plan goes out, the
    next one is planned ahead when the core allows (Scheduler.schedule_ahead), and the
    arrivals and aborts of a step are applied while that one is in flight."""
    wire = wire or (lambda msg: msg)
    sched = Scheduler(config, num_gpu_blocks, num_cpu_blocks)
    ex = FakeExecutor(num_gpu_blocks, num_cpu_blocks, config.block_size)
    results: dict[str, RequestResult] = {}
    abort_at: dict[int, list[str]] = {}
    for arrival, req in requests:
        if aborts and req.request_id in aborts:
            abort_at.setdefault(arrival + aborts[req.request_id], []).append(req.request_id)
    i, step, sent_ahead, planned_ahead = 0, 0, None, 0
    while i < len(requests) or sched.has_unfinished() or sent_ahead is not None:
        while i < len(requests) and requests[i][0] <= step:
            sched.add_request(requests[i][1])
            i += 1
        for rid in abort_at.pop(step, ()):
            out = sched.abort_request(rid)
            if out is not None:
                _collect(results, [wire(out)])
        plan, sent_ahead = (sched.schedule(), None) if sent_ahead is None else (sent_ahead, None)
        if plan is not None:
            plan = wire(plan)
            if ahead:
                sent_ahead = sched.schedule_ahead()
                if sent_ahead is not None:
                    planned_ahead += 1
                    sent_ahead = wire(sent_ahead)
            outputs = sched.update(plan, wire(ex.execute(plan))).request_outputs()
            _collect(results, [wire(o) for o in outputs])
        step += 1
        if step > max_steps:
            raise AssertionError("the scheduler stopped making progress")
    st = sched.stats()
    return SimRun(results, step, st.num_preemptions, st.swapped_out_blocks_total,
                  st.prefix_cache_hits, sched, planned_ahead)
