"""The figures a Scheduler reports (read at scrape time by the service's metrics)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler


@dataclass(slots=True)
class SchedulerStats:
    num_running: int                 # requests
    num_waiting: int
    num_swapped: int
    num_running_seqs: int            # sequences in running requests
    gpu_blocks_used: int             # referenced by some block table
    gpu_blocks_free: int             # allocatable now, cached-but-unreferenced included
    gpu_blocks_cached: int           # registered in the prefix cache (used or free)
    gpu_blocks_total: int
    gpu_blocks_logical: int          # block-table entries: what the used blocks would be unshared
    cpu_blocks_used: int
    cpu_blocks_total: int
    token_slots_allocated: int       # gpu_blocks_used * block_size
    token_slots_filled: int          # of those, slots holding a token
    num_preemptions: int             # totals since start, from here on
    swapped_out_blocks_total: int
    swapped_in_blocks_total: int
    prefix_cache_queries: int        # prompt tokens looked up (vLLM counts tokens)
    prefix_cache_hits: int           # prompt tokens found
    prompt_tokens_total: int         # prompt positions computed (recomputation included)
    generation_tokens_total: int     # tokens sampled
    steps_total: int                 # plans built
    steps_planned_ahead_total: int   # of them, planned while the step before ran (ahead.py)


def scheduler_stats(sched: Scheduler) -> SchedulerStats:
    """The figures of `sched` now."""
    bm = sched.block_manager
    gpu = bm.gpu
    return SchedulerStats(
        num_running=len(sched.running), num_waiting=sched.num_waiting,
        num_swapped=len(sched.swapped),
        num_running_seqs=sum(len(g.seqs) for g in sched.running),
        gpu_blocks_used=gpu.num_used, gpu_blocks_free=gpu.num_free,
        gpu_blocks_cached=len(gpu.cached), gpu_blocks_total=gpu.num_blocks,
        gpu_blocks_logical=gpu.num_refs,
        cpu_blocks_used=bm.cpu.num_used, cpu_blocks_total=bm.cpu.num_blocks,
        token_slots_allocated=gpu.num_used * sched.block_size,
        token_slots_filled=gpu.num_filled_slots,
        num_preemptions=sched.num_preemptions,
        swapped_out_blocks_total=bm.swapped_out_blocks_total,
        swapped_in_blocks_total=bm.swapped_in_blocks_total,
        prefix_cache_queries=sched.prefix_cache_queries,
        prefix_cache_hits=sched.prefix_cache_hits,
        prompt_tokens_total=sched.prompt_tokens_total,
        generation_tokens_total=sched.generation_tokens_total,
        steps_total=sched._step_id, steps_planned_ahead_total=sched.num_planned_ahead)
