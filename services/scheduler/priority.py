"""Priority preemption: which running groups a more important waiting request may push out.

Under the priority policy, when the most important waiting request cannot be admitted,
running groups of strictly lower priority are preempted (latest first, by recompute: their
blocks are freed and they wait in the queue behind it) until it can be:

- only when the victims together make room (seats and blocks), else nobody is preempted;
- never for a request of equal or lower priority (under equal priorities nothing changes:
  first come, first served);
- never while groups are swapped out (they resume before any admission; the caller checks);
- victims are chosen before anything is scheduled in the step.

The same counting serves fairness between tenants: with no running group of lower priority,
a waiting request of a tenant with nothing running may preempt the groups of tenants over
their share (fairness.py).
"""
from __future__ import annotations

from bisect import bisect_right

from services.scheduler.block_manager import BlockManager
from services.scheduler.config import SchedulerConfig
from services.scheduler.fairness import fair_candidates
from services.scheduler.sequence import SequenceGroup


def preemptible(head: SequenceGroup, running: list[SequenceGroup]
                ) -> tuple[list[SequenceGroup], bool]:
    """The running groups `head` may preempt, in queue order, and whether that is for its
    tenant's fair share: those of lower priority (they end the queue) if any, else those of
    tenants over their share (fairness.fair_candidates)."""
    lower = running[bisect_right(running, head.sort_key[0], key=_priority):]
    if lower:
        return lower, False
    fair = fair_candidates(head, running)
    return fair, bool(fair)


def _priority(group: SequenceGroup) -> int:
    return group.sort_key[0]


def victims_for(head: SequenceGroup, candidates: list[SequenceGroup], num_running_seqs: int,
                config: SchedulerConfig, bm: BlockManager, headroom: int
                ) -> list[SequenceGroup]:
    """The running groups to preempt so that `head` is admitted this step, latest first;
    empty when it fits already, or when even all those it may preempt would not make room.
    `candidates`: the running groups it may preempt, in queue order (those of lower priority;
    or fairness.fair_candidates); `headroom` is the free blocks admitting `head` must leave
    (Scheduler._headroom)."""
    if not candidates:
        return []
    seat_short = num_running_seqs + head.max_num_seqs - config.max_num_seqs
    # Its first chunk shares the step with the decodes of those who stay.
    budget = max(1, config.max_num_batched_tokens - num_running_seqs)
    _, need = bm.blocks_to_admit(head, budget)
    block_short = need + headroom - bm.num_free_blocks
    if seat_short <= 0 and block_short <= 0:
        return []                                    # it fits: admitted as usual
    victims: list[SequenceGroup] = []
    for group in reversed(candidates):
        if seat_short <= 0 and block_short <= 0:
            break
        victims.append(group)
        seat_short -= group.max_num_seqs
        block_short -= bm.blocks_freed_by(group.seqs)
        # Fewer running seqs: less headroom is kept for their growth.
        block_short -= int(config.growth_reserve * group.max_num_seqs)
    if seat_short > 0 or block_short > 0:
        return []
    return victims
