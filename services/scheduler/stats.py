"""The figures a Scheduler reports (read at scrape time by the service's metrics)."""
from __future__ import annotations

from dataclasses import dataclass


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
