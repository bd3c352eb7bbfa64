"""Priority preemption: which running groups a more important waiting request may push out.

Under the priority policy, when the most important waiting request cannot be admitted,
running groups of strictly lower priority are preempted (latest first, by recompute: their
blocks are freed and they wait in the queue behind it) until it can be:

- only when the victims together make room (seats and blocks), else nobody is preempted;
- never for a request of equal or lower priority (under equal priorities nothing changes:
  first come, first served);
- never while groups are swapped out (they resume before any admission; the caller checks);
- victims are chosen before anything is scheduled in the step.
"""
from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.config import SchedulerConfig
from services.scheduler.sequence import SequenceGroup


def victims_for(head: SequenceGroup, running: list[SequenceGroup], num_running_seqs: int,
                config: SchedulerConfig, bm: BlockManager, headroom: int
                ) -> list[SequenceGroup]:
    """The running groups to preempt so that `head` is admitted this step, latest first;
    empty when it fits already, or when even all those it may preempt would not make room.
    `running` is in queue order; `headroom` is the free blocks admitting `head` must leave
    (Scheduler._headroom)."""
    if not running or running[-1].priority <= head.priority:
        return []
    seat_short = num_running_seqs + head.max_num_seqs - config.max_num_seqs
    # Its first chunk shares the step with the decodes of those who stay.
    budget = max(1, config.max_num_batched_tokens - num_running_seqs)
    _, need = bm.blocks_to_admit(head, budget)
    block_short = need + headroom - bm.num_free_blocks
    if seat_short <= 0 and block_short <= 0:
        return []                                    # it fits: admitted as usual
    victims: list[SequenceGroup] = []
    for group in reversed(running):
        if group.priority <= head.priority or (seat_short <= 0 and block_short <= 0):
            break
        victims.append(group)
        seat_short -= group.max_num_seqs
        block_short -= bm.blocks_freed_by(group.seqs)
        # Fewer running seqs: less headroom is kept for their growth.
        block_short -= int(config.growth_reserve * group.max_num_seqs)
    if seat_short > 0 or block_short > 0:
        return []
    return victims
