"""Async scheduling: the next step planned while the executors run the one before.

Without it the executors idle between two steps for as long as the scheduler takes to
apply a result, publish it, plan the next step and send it (plus the wire both ways): on a
GPU, whose decode step takes milliseconds, that gap is a share of every step. With it:

    scheduler  plan k, plan k+1 ─▶ · result k: apply, publish; plan k+2 ─▶ · result k+1 ...
    executor        [ step k ........... ][ step k+1 ............ ][ step k+2 ...
                                         ▲ no wait: plan k+1 was queued

A step is planned ahead only when the step in flight ran nothing but the running queue's
lead (lead.py: one-seq requests decoding steadily) with every running seq in it, and
nothing waits or is swapped out. Then the sync scheduler's next plan would be exactly the
lead's decodes again, so the ahead plan is that, with two differences:

- each row's input token is the one the step in flight samples, unknown when planning:
  the row carries -1 and the executor puts in the token it sampled for that seq in its
  last step (shared/messages.py, StepPlan);
- a seq that reaches max_tokens (or max_model_len) with the step in flight gets no row;
  one that samples a stop token in it, which nobody knows yet, still has a row in the
  ahead step: that row is wasted, and applying its result skips it (outputs.py: the seq
  is no longer running). The blocks the seq freed are written by that row before any
  later step runs (the executors run plans in order), and none of them is in the prefix
  cache with the position the row writes (that block's registration waits, below).

A block the ahead step fills is registered in the prefix cache when the step before's
result is applied (`register`), once its last token is known, not when it is planned.
Anything else (a new request, an abort, a prefill, a preemption) makes the next plan wait
for the result as before: the scheduler service plans ahead again from the next quiet
step. The service plans ahead only for an executor of one rank (its other ranks never see
the sampled tokens), and by default (`--async-scheduling auto`) only when it runs on an
accelerator: a CPU forward shares its cores with the scheduler (docs/overhead.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from services.scheduler.plan import PlanBuilder
from services.scheduler.sequence import SequenceStatus
from shared.messages import StepPlan

if TYPE_CHECKING:
    from services.scheduler.outputs import StepOutputs
    from services.scheduler.scheduler import Scheduler

RUNNING = SequenceStatus.RUNNING


def schedule_ahead(core: Scheduler) -> StepPlan | None:
    """The step after the one in flight, planned now (see above). None when the next step
    needs that one's result first (then: update, then schedule())."""
    lead = core.lead
    if len(core._inflight) != 1 or core.num_waiting or core.swapped or core.num_constrained:
        return None
    _, _, seqs, swapped_out, _ = core._inflight[0]
    if (seqs or swapped_out or not core.running or len(lead) != len(core.running)
            or lead.scheduled[lead.order].min() < 1):
        return None                      # a row besides the lead's, or a seq not in flight
    step = PlanBuilder(core.block_manager, core.config.max_num_batched_tokens,
                       core._pending_finished)
    put_off: list = []
    if not lead.schedule(step, ahead=put_off):
        return None                      # no budget, or no free block for the first seq
    core._pending_finished = []
    core._held_last = False              # as schedule() would find: nothing waits
    core._step_id += 1
    core.num_planned_ahead += 1
    plan, _ = step.build(core._step_id)
    core._inflight.append((core._step_id, step.lead[:2], [], [], put_off))
    return plan


def register(core: Scheduler, news: StepOutputs) -> StepOutputs:
    """After a result is applied: the prefix-cache registrations of the plan now in flight,
    if it was planned ahead, whose blocks' last tokens that result sampled. Returns `news`."""
    if core._inflight:
        for seq, num_tokens in core._inflight[0][4] or ():
            if seq.status is RUNNING:
                core.block_manager.cache_computed_blocks(seq, num_tokens)
    return news
