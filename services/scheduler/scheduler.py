"""The iteration-level scheduler: one StepPlan per model step, continuous batching.

Each step spends a token budget (max_num_batched_tokens) over, in this order:

    running groups   decodes (1 token per seq) and prefill chunks, in queue order;
                     when blocks run short, the lowest-priority latest-arrived running group
                     is preempted (swapped to CPU, or dropped and later recomputed)
    swapped groups   swapped back in, only in a step that preempted nothing
    waiting groups   admitted with a first prefill chunk, only when nothing is swapped out;
                     running groups of lower priority, or of a tenant over its fair share,
                     are preempted (recompute) to admit a waiting request that does not fit

Prefill chunks and decodes share a step (chunked prefill), but for first-token steps
(fairness.py). This module is the policy: the queues, the admission order (fairness.py:
tenants' fair shares), the victims (priority.py: those of a more important waiting
request). Blocks are block_manager.py's, the plan's rows plan.py's, applying a result
outputs.py's, a grammar's hooks constrained.py's, the running queue's steady lead lead.py's.

Parallel sampling (n > 1) computes the prompt once: seq 0 prefills all but the last prompt
token, then n seqs fork from it, sharing its blocks; each computes the last prompt token
itself (copy-on-write of the shared partial block) and samples its own first token.
"""
from __future__ import annotations

import heapq
import itertools
from bisect import insort
from operator import attrgetter

from services.scheduler import ahead, outputs
from services.scheduler.admission import AdmissionError, check_admission
from services.scheduler.beam_search import BeamSearch
from services.scheduler.block_manager import BlockManager
from services.scheduler.contiguous import block_manager_for
from services.scheduler.config import SchedulerConfig
from services.scheduler.fairness import FairQueue, first_token_step
from services.scheduler.grammar import Grammars, admit_constrained
from services.scheduler.lead import Lead
from services.scheduler.plan import PlanBuilder, drop_from_executors
from services.scheduler.priority import preemptible, victims_for
from services.scheduler.sequence import Sequence, SequenceGroup, SequenceStatus
from services.scheduler.stats import SchedulerStats, scheduler_stats
from shared.messages import GenerationRequest, RequestOutput, SeqDelta, StepPlan, StepResult

WAITING = SequenceStatus.WAITING
RUNNING = SequenceStatus.RUNNING
SWAPPED = SequenceStatus.SWAPPED
FINISHED = SequenceStatus.FINISHED

_sort_key = attrgetter("sort_key")

__all__ = ["AdmissionError", "Scheduler", "SchedulerStats"]


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        if num_gpu_blocks < 1:
            raise ValueError("the executor reported no GPU KV blocks: give it more memory")
        self.config = config
        self.block_size = config.block_size
        self._new_pool(num_gpu_blocks, num_cpu_blocks)
        self.grammars = Grammars(config.model)   # compiled off the step's path, cached by spec
        self.refused: list[RequestOutput] = []   # ended at the queue's head (a bad grammar)
        self.groups: dict[str, SequenceGroup] = {}        # every unfinished request
        self.num_constrained = 0      # of them, those that follow a grammar
        self.waiting: list[tuple[tuple, SequenceGroup]] = []   # heap; aborted entries skipped
        self.num_waiting = 0
        self.running: list[SequenceGroup] = []             # sorted by sort_key
        self.swapped: list[SequenceGroup] = []             # sorted by sort_key
        self.num_running_seqs = 0     # seq slots held by running groups (a group holds its max)
        self._pending_finished: list[int] = []   # seq ids the executors must drop next plan
        # The plans in flight, oldest first (ahead.py): (step id, lead rows' (slots, seq ids)
        # or None, each later row's Sequence, seqs swapped out, registrations put off).
        self._inflight: list[tuple] = []
        self._step_id = 0
        self.seq_ids = itertools.count()    # a new Sequence's id
        self._orders = itertools.count()    # queue order: (priority, fair start, arrival)
        self.fair = FairQueue()
        # Per schedule(): a group was preempted for blocks (then nothing is swapped in or
        # admitted), and the admission bound of preemption for the waiting (only groups that sort
        # before it are admitted this step; its victims are being dropped in this plan).
        self._preempted = False
        self._admit_below: tuple | None = None
        self._held_last = False       # the last step was a first-token step (fairness.py)
        self.num_preemptions = self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.num_planned_ahead = 0    # steps planned while the one before ran (ahead.py)
        self.prompt_tokens_total = self.generation_tokens_total = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, req: GenerationRequest) -> None:
        """Queue a request. Raises AdmissionError if it could never run, even alone.

        A request id already in flight is ignored: that is a redelivery of the same request
        (e.g. a queue entry claimed again), not a second request.
        """
        cfg = self.config
        sp = req.sampling
        L = len(req.prompt_token_ids)
        if req.request_id in self.groups:
            return
        check_admission(req, cfg, self.block_manager)
        key = (req.priority if cfg.policy == "priority" else 0, self.fair.start(req),
               next(self._orders))
        group = SequenceGroup(req, key)
        group.max_len = min(group.max_len, cfg.max_model_len)
        for _ in range(1 if group.is_beam else sp.n):
            group.seqs.append(group.new_seq(next(self.seq_ids), list(req.prompt_token_ids), L))
        if group.is_beam:
            group.beam = BeamSearch(sp, L, cfg.max_model_len)
        self.groups[req.request_id] = group
        self.num_constrained += sp.constraint is not None
        heapq.heappush(self.waiting, (key, group))
        self.num_waiting += 1

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Finish a request now and free everything it holds. Returns its final output
        (every unfinished seq with finish_reason=reason; for beam search, the n best beams so
        far, whole, since beams stream nothing), or None if the id is unknown."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        out = outputs.final_output(group, reason)
        self.finish_group(group)
        return out

    def abort_seq(self, request_id: str, index: int, reason: str = "abort"
                  ) -> RequestOutput | None:
        """Finish one sequence (sample index `index`) of a request of n > 1 now and free its
        blocks; the others go on. The request's last sequence ends the request, as
        abort_request does. Returns its final delta, or None when there is nothing to do:
        unknown request or index, a sequence already finished, beam search (beams are chosen
        together), or the leader of a group that has not forked yet (the others wait for the
        prefix it computes; it goes on, and the caller ignores its tokens)."""
        group = self.groups.get(request_id)
        if group is None or group.is_beam:
            return None
        seq = next((s for s in group.seqs if s.sample_index == index), None)
        if seq is None:
            return None
        if len(group.seqs) == 1:
            return self.abort_request(request_id, reason)
        if group.needs_fork and seq is group.seqs[0]:
            return None
        seq.finish_reason = reason
        self.release_seq(seq)
        group.seqs.remove(seq)
        return outputs.request_output(group, [SeqDelta(
            seq.sample_index, [], finish_reason=reason, cumulative_logprob=seq.cumulative_logprob)])

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> StepPlan | None:
        """Build the next step. None when there is nothing to run (then seq ids to drop wait
        for the next plan). Raises RuntimeError if the previous plan was not update()d."""
        if self._inflight:
            raise RuntimeError("schedule() called again before update() of the previous plan")
        step = PlanBuilder(self.block_manager, self.config.max_num_batched_tokens,
                           self._pending_finished, self.num_constrained > 0)
        self._pending_finished = []
        self._preempted = False
        self._admit_below = None
        for group in self.grammars.ready():    # compiled since: back into the queue
            heapq.heappush(self.waiting, (group.sort_key, group))
        if self.running and self.waiting and not self.swapped:
            self._preempt_for_waiting(step)
        if not self._first_token_step(step):
            self._schedule_running(step)
            if not self._preempted:
                self._schedule_swapped(step)
                if not self.swapped:
                    self._schedule_waiting(step)
        if step.is_empty:
            self._pending_finished = step.finished_seq_ids
            if self.grammars.wait():    # only a grammar compiles: wait for it, then admit
                return self.schedule()
            return None
        self._step_id += 1
        plan, seqs = step.build(self._step_id)
        self._inflight.append((self._step_id, step.lead and step.lead[:2], seqs,
                               step.swapped_out_seqs, None))
        return plan

    def _first_token_step(self, step: PlanBuilder) -> bool:
        """Admit the waiting requests fairness.first_token_step picks alone in this step,
        never in two steps in a row. Whether it did."""
        head = None if self._held_last or self.swapped else self._waiting_head()
        if head is not None and first_token_step(head, self.running):
            self._schedule_waiting(step, first_tokens=True)
            self._held_last = not step.is_empty
        else:
            self._held_last = False
        return self._held_last

    def _schedule_running(self, step: PlanBuilder) -> None:
        """In queue order: the lead's decodes on columns (lead.py), runs of one-seq decodes
        in one pass (decode_slots, add_decodes), any other group by _schedule_group."""
        running = self.running
        self.lead.extend(running)
        i = self.lead.schedule(step)
        self.lead.cut(i)                # the rest, if the budget or the blocks ran out
        while i < len(running) and step.budget > 0:
            decodes = self.block_manager.decode_slots(running, i, step.budget)
            step.add_decodes(decodes)
            i += len(decodes)
            if i < len(running) and step.budget > 0:
                # NOTE: a preemption only removes groups from the end of `running` (the
                # latest, possibly this group itself): the groups before i stay where they are.
                group = running[i]
                self._schedule_group(group, step, may_preempt=True)
                if group.status == RUNNING:
                    i += 1

    def _schedule_swapped(self, step: PlanBuilder) -> None:
        bm = self.block_manager
        while self.swapped and step.budget > 0:
            group = self.swapped[0]
            if self.num_running_seqs + group.max_num_seqs > self.config.max_num_seqs:
                return
            need = bm.blocks_to_swap_in(group.seqs, group.work(step.budget))
            if bm.num_free_blocks - need < self._headroom(group):
                return
            self.swapped.pop(0)
            step.add_swap_in(group.seqs, bm.swap_in(group.seqs))
            for s in group.seqs:
                s.status = RUNNING
            self._start_running(group)
            self._schedule_group(group, step, may_preempt=False)

    def _schedule_waiting(self, step: PlanBuilder, first_tokens: bool = False) -> None:
        bm = self.block_manager
        waiting = self.waiting
        while waiting and step.budget > 0:
            group = waiting[0][1]
            if group.status != WAITING:          # aborted while queued
                heapq.heappop(waiting)
                continue
            if first_tokens and not first_token_step(group, self.running):
                return
            if self._admit_below is not None and group.sort_key >= self._admit_below:
                return
            if self.num_running_seqs + group.max_num_seqs > self.config.max_num_seqs:
                return
            if group.sampling.constraint is not None and group.seqs[0].matcher is None:
                if not admit_constrained(self, group):  # compiling: the queue moves on
                    heapq.heappop(waiting)
                    continue
            cached, need = bm.blocks_to_admit(group, step.budget)
            if bm.num_free_blocks - need < self._headroom(group):
                return
            heapq.heappop(waiting)
            self.num_waiting -= 1
            self.fair.admitted(group.sort_key[1])
            # (a recomputed seq may hit its own output too: only prompt tokens count)
            hit = min(len(cached) * self.block_size, group.prompt_len)
            if bm.enable_prefix_caching and group.prompt_logprobs is None:
                self.prefix_cache_queries += group.prompt_len
                self.prefix_cache_hits += hit
            if cached:
                bm.use_cached_prefix(group.seqs[0], cached)
            if not group.first_output_sent:
                group.num_cached_tokens = hit
            for s in group.seqs:
                s.status = RUNNING
            self._start_running(group)
            self._schedule_group(group, step, may_preempt=False)

    def _waiting_head(self) -> SequenceGroup | None:
        """The next waiting group to admit (queue entries of aborted groups dropped)."""
        waiting = self.waiting
        while waiting and waiting[0][1].status != WAITING:
            heapq.heappop(waiting)
        return waiting[0][1] if waiting else None

    def _preempt_for_waiting(self, step: PlanBuilder) -> None:
        """Preempt, by recompute, the running groups that keep the waiting head out: of lower
        priority (priority.py chooses), else of a tenant over its share (fairness.py)."""
        head = self._waiting_head()
        if head is None:
            return
        cands, fair = preemptible(head, self.running)
        victims = victims_for(head, cands, self.num_running_seqs, self.config,
                              self.block_manager, self._headroom(head))
        for group in victims:
            if fair:                     # to the back of its tenant's line
                group.sort_key = self.fair.requeue(group, next(self._orders))
            self._preempt(group, step, mode="recompute")
        if victims:
            self._preempted = False  # these were for admission: the step goes on to admit
            self._admit_below = min(g.sort_key for g in victims)

    def _headroom(self, group: SequenceGroup) -> int:
        """Free blocks that admitting (or swapping in) `group` must leave for the running seqs
        and its own to grow.

        NOTE: without it, a group preempted for lack of blocks is readmitted as soon as its
        prompt fits, grows, and is preempted again: recompute thrash. Reserving about one
        block per seq lets them all reach their next block first (docs/kv_memory.md measures
        growth_reserve). Nothing running: no headroom, so a request that fits the empty pool
        always starts (no deadlock).
        """
        if not self.running or not self.block_manager.grows_on_demand:
            return 0
        seqs = self.num_running_seqs + group.max_num_seqs
        return self.watermark_blocks + int(self.config.growth_reserve * seqs)

    def _start_running(self, group: SequenceGroup) -> None:
        group.status = RUNNING
        self.num_running_seqs += group.max_num_seqs
        self.lead.enter(self.running, group)

    def _make_room(self, group: SequenceGroup, step: PlanBuilder, may_preempt: bool) -> bool:
        """Free blocks by preempting the latest running group. False when `group` may not
        preempt, or had to go itself."""
        if not may_preempt:
            return False
        victim = self.running[-1]
        self._preempt(victim, step)
        return victim is not group

    def _schedule_group(self, group: SequenceGroup, step: PlanBuilder, may_preempt: bool) -> bool:
        """Schedule one running group's work, preempting later groups for blocks when
        `may_preempt`. Returns False if the group was preempted itself (or, when it may not
        preempt, could not get its blocks)."""
        bm = self.block_manager
        seqs = group.seqs
        if group.needs_fork and seqs[0].num_computed_tokens >= group.fork_point:
            while bm.num_free_blocks < bm.blocks_to_fork(group):
                if not self._make_room(group, step, may_preempt):
                    return group.status == RUNNING
            leader = seqs[0]
            for seq in seqs[1:]:
                step.copy.extend(bm.fork(leader, seq))
            group.forked = True
        work = group.work(step.budget)
        if not work:
            return True
        while bm.num_free_blocks < bm.blocks_for(work):
            if not self._make_room(group, step, may_preempt):
                return group.status == RUNNING
        for seq, t in work:
            step.add(seq, t, bm.allocate_slots(seq, t))
        return True

    def _preempt(self, group: SequenceGroup, step: PlanBuilder, mode: str | None = None) -> None:
        """Take a running group off the GPU: swap its blocks out, or drop them to recompute."""
        bm = self.block_manager
        mode = mode or self.config.preemption_mode
        if mode == "auto":
            mode = "swap" if len(group.seqs) > 1 else "recompute"
        if mode == "swap" and not bm.can_swap_out(group.seqs):
            mode = "recompute"   # the CPU pool is full: recomputing is always possible
        self.lead.leave(self.running, group)
        self.num_running_seqs -= group.max_num_seqs
        self.num_preemptions += 1
        group.num_preemptions += 1
        self._preempted = True
        if mode == "swap":
            step.add_swap_out(group.seqs, bm.swap_out(group.seqs))
            for seq in group.seqs:
                seq.status = SWAPPED
            group.status = SWAPPED
            insort(self.swapped, group, key=_sort_key)
            return
        for seq in group.seqs:
            bm.free(seq)
            drop_from_executors(seq, step.finished_seq_ids)
            seq.num_computed_tokens = 0
        group.to_recompute()
        heapq.heappush(self.waiting, (group.sort_key, group))
        self.num_waiting += 1

    # ------------------------------------------------------------------ update
    def update(self, plan: StepPlan, result: StepResult) -> outputs.StepOutputs:
        """Apply a step's result (outputs.py). Returns the news of every request that has
        some (new tokens, a finish), columnar. A step that failed (its `error`, or a result
        that does not fit the plan) fails the requests it ran or moved, and only those."""
        if not self._inflight or self._inflight[0][0] != plan.step_id:
            raise ValueError(f"update() for step {plan.step_id}, but the plan in flight is "
                             f"{self._inflight[0][0] if self._inflight else None}")
        if result.step_id != plan.step_id:
            raise ValueError(f"the result of step {result.step_id} does not answer step "
                             f"{plan.step_id}")
        _, lead_rows, seqs, swapped_out, _ = self._inflight.pop(0)
        error = outputs.result_error(plan, result)
        if error is None:
            return ahead.register(self, outputs.apply_result(self, plan, seqs, result, lead_rows))
        led = self.lead.seqs_of(lead_rows[0]) if lead_rows else []
        return ahead.register(self, outputs.fail_step(self, led + seqs + swapped_out, error))

    def fail_unsent(self, plan: StepPlan, error: str) -> outputs.StepOutputs:
        """The plan in flight could not be sent: its requests fail as in a failed step (see
        update). The executors never saw it, so the seqs it told them to drop go with the next."""
        self._pending_finished.extend(plan.finished_seq_ids)
        return self.update(plan, StepResult(plan.step_id, error=error))

    # ------------------------------------------------------------------ finishing
    def release_seq(self, seq: Sequence) -> None:
        """Free a seq's blocks (taking back the prefix-cache entries of a step in flight) and
        tell the executors to drop it with the next plan."""
        self.block_manager.uncache_scheduled(seq)
        self.block_manager.free(seq)
        drop_from_executors(seq, self._pending_finished)
        seq.status = FINISHED

    def finish_group(self, group: SequenceGroup, prune_running: bool = True) -> None:
        """Release everything a request holds, whatever its state."""
        status = group.status
        if status == RUNNING:
            self.num_running_seqs -= group.max_num_seqs
            if prune_running:
                self.lead.leave(self.running, group)
        elif status == SWAPPED:
            self.swapped.remove(group)
        elif status == WAITING:
            self.num_waiting -= 1       # its heap entry is skipped when reached
        for seq in group.seqs:
            self.release_seq(seq)
        group.seqs = []
        group.status = FINISHED
        if self.groups.pop(group.request_id, None) is not None:
            self.num_constrained -= group.sampling.constraint is not None

    # ------------------------------------------------------------------ executor loss
    def recompute_all(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """The executors lost every KV block (an executor restarted, or its state after a
        failed step is unknown): start over on a fresh pool of this size. Every unfinished
        request waits again, in queue order, to be recomputed from its prompt and output so
        far, as after a preemption by recompute; the plan in flight is forgotten."""
        self.lead.cut(0)
        self._new_pool(num_gpu_blocks, num_cpu_blocks)
        self._inflight.clear()
        self._pending_finished = []
        self.running, self.swapped, self.num_running_seqs = [], [], 0
        for group in self.groups.values():
            for seq in group.seqs:
                seq.forget_blocks()
            group.to_recompute()
        self.waiting = sorted((g.sort_key, g) for g in self.groups.values())   # a heap
        self.num_waiting = len(self.waiting)

    def _new_pool(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.block_manager: BlockManager = block_manager_for(self.config, num_gpu_blocks,
                                                             num_cpu_blocks)
        self.watermark_blocks = int(self.config.watermark * num_gpu_blocks)
        self.lead = Lead(self.block_manager)

    schedule_ahead = ahead.schedule_ahead    # -> StepPlan | None (ahead.py)
    stats = scheduler_stats      # -> SchedulerStats (stats.py)
