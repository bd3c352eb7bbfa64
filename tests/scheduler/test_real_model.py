"""The scheduler driving the real executor (SmolLM2-135M on the CPU) through a KV pool so small
that requests are preempted: swapped or recomputed, they must produce exactly the tokens they
produce on a pool that never runs short (greedy, seeded sampling with n = 3, beam search)."""
from __future__ import annotations

import pytest

from services.executor.config import ExecutorConfig
from services.executor.model_runner import ModelRunner
from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from shared.messages import GenerationRequest, SamplingParams

SYSTEM = [1, 504, 3458, 314, 253, 1420, 282, 30, 2010, 1173, 288, 314, 5248, 28, 9489, 30]


def requests() -> list[GenerationRequest]:
    prompts = [SYSTEM + list(range(1000 + 37 * i, 1020 + 40 * i)) for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=16),
              SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=16),
              SamplingParams(temperature=0.0, beam_width=3, n=2, max_tokens=12),
              SamplingParams(temperature=0.0, max_tokens=16, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=16)]
    return [GenerationRequest(f"r{i}", p, sp, arrival_time=float(i))
            for i, (p, sp) in enumerate(zip(prompts, params))]


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(ExecutorConfig(device="cpu", dtype="float32", max_model_len=256,
                                      num_gpu_blocks=256, swap_space_gib=0.02, num_threads=1))


def generate(runner, num_gpu_blocks: int, mode: str,
             prefix_caching: bool = True) -> tuple[dict, Scheduler]:
    cfg = SchedulerConfig(block_size=runner.block_size, max_model_len=256,
                          preemption_mode=mode, growth_reserve=0.0,
                          enable_prefix_caching=prefix_caching)
    sched = Scheduler(cfg, num_gpu_blocks, min(runner.num_cpu_blocks, 16))
    tokens, _ = run_to_end(sched, runner, requests())
    return tokens, sched


def run_to_end(sched: Scheduler, runner, reqs: list[GenerationRequest]) -> tuple[dict, dict]:
    """Every request's tokens and finish reason, keyed (request id, sequence index)."""
    for r in reqs:
        sched.add_request(r)
    tokens: dict[tuple[str, int], list[int]] = {}
    reasons: dict[tuple[str, int], str] = {}
    while sched.has_unfinished():
        plan = sched.schedule()
        result = runner.execute(plan)
        assert result.error is None, result.error
        for out in sched.update(plan, result).request_outputs():
            for d in out.seqs:
                tokens.setdefault((out.request_id, d.index), []).extend(d.token_ids)
                if d.finish_reason:
                    reasons[(out.request_id, d.index)] = d.finish_reason
    return tokens, reasons


def test_preempted_requests_reproduce_their_tokens_on_the_real_model(runner):
    want, _ = generate(runner, 256, "recompute")
    assert len(want) == 1 + 3 + 2 + 1 + 1
    assert len({tuple(want[("r1", i)]) for i in range(3)}) > 1     # the samples differ
    for mode in ("swap", "recompute"):
        got, sched = generate(runner, 14, mode)
        st = sched.stats()
        assert st.num_preemptions >= 2, mode
        assert (st.swapped_out_blocks_total > 0) == (mode == "swap")
        assert st.prefix_cache_hits > 0 and st.gpu_blocks_used == 0
        assert got == want, mode


def test_prompts_admitted_together_share_their_prefix_and_match_a_run_without_cache(runner):
    # All five prompts start with the same 16-token block and are admitted in the first step:
    # r0 computes that block and the four others map it in the same step, reading the K/V r0
    # writes there (the executor writes a layer's K/V for the whole batch before attention).
    cached, sched = generate(runner, 256, "recompute")
    first = sched.stats()
    assert first.prefix_cache_hits == 4 * len(SYSTEM)
    uncached, _ = generate(runner, 256, "recompute", prefix_caching=False)
    assert cached == uncached
