"""The iteration-level scheduler: one StepPlan per model step, continuous batching.

Each step spends a token budget (max_num_batched_tokens) over, in this order:

    running groups   decodes (1 token per seq) and prefill chunks, by priority/arrival;
                     when blocks run short, the lowest-priority latest-arrived running group
                     is preempted (swapped to CPU, or dropped and later recomputed)
    swapped groups   swapped back in, only in a step that preempted nothing
    waiting groups   admitted with a first prefill chunk, only when nothing is swapped out;
                     under the priority policy, running groups of lower priority are
                     preempted (recompute) to admit a waiting request that does not fit

Prefill chunks and decodes share a step (chunked prefill). The plan tells the executors only
what changed: new sequences whole, known ones as token and block-table diffs. `update()`
applies the sampled tokens and returns each request's news as a RequestOutput.

Parallel sampling (n > 1) computes the prompt once: seq 0 prefills all but the last prompt
token, then n seqs fork from it, sharing its blocks; each computes the last prompt token
itself (copy-on-write of the shared partial block) and samples its own first token.
"""
from __future__ import annotations

import heapq
from bisect import insort
from operator import attrgetter

from services.scheduler.admission import AdmissionError, check_admission
from services.scheduler.beam_search import BeamSearch
from services.scheduler.block_manager import BlockManager
from services.scheduler.config import SchedulerConfig
from services.scheduler.sequence import Sequence, SequenceGroup, SequenceStatus
from services.scheduler.stats import SchedulerStats
from shared.messages import (GenerationRequest, NewSeq, RequestOutput, ScheduledSeq, SeqDelta,
                             SeqSample, StepPlan, StepResult, TokenLogprob)

WAITING = SequenceStatus.WAITING
RUNNING = SequenceStatus.RUNNING
SWAPPED = SequenceStatus.SWAPPED
FINISHED = SequenceStatus.FINISHED

_sort_key = attrgetter("sort_key")

# NOTE: most plan entries carry no new blocks and most outputs no logprobs; they all share one
# empty list each instead of allocating one per sequence per step (at 1,000 sequences that is
# 2,000 fewer objects per step for the allocator and the garbage collector). Nothing appends
# to a message's lists after it is built (the wires carry copies): never append to these.
_NO_BLOCKS: list[int] = []
_NO_LOGPROBS: list[TokenLogprob] = []

__all__ = ["AdmissionError", "Scheduler", "SchedulerStats"]


class _Step:
    """What one schedule() call accumulates before it becomes a StepPlan."""

    __slots__ = ("budget", "seqs", "new_seqs", "scheduled", "swap_out", "swap_in", "copy",
                 "finished", "preempted", "admit_below")

    def __init__(self, budget: int, finished: list[int]) -> None:
        self.budget = budget
        self.seqs: list[Sequence] = []
        # The plan's entries, built as each seq is scheduled (see Scheduler._emit):
        self.new_seqs: list[NewSeq] = []
        self.scheduled: list[ScheduledSeq] = []
        self.swap_out: list[list[int]] = []
        self.swap_in: list[list[int]] = []
        self.copy: list[list[int]] = []
        self.finished = finished
        self.preempted = False
        # Priority preemption: only groups that sort before this key are admitted this step
        # (its victims wait at least one step: their seq ids are being dropped in this plan).
        self.admit_below: tuple | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        if num_gpu_blocks < 1:
            raise ValueError("the executor reported no GPU KV blocks: give it more memory")
        self.config = config
        self.block_size = config.block_size
        reserve = config.max_blocks_per_seq if config.contiguous else 0
        self.block_manager = BlockManager(num_gpu_blocks, max(0, num_cpu_blocks),
                                          config.block_size, config.enable_prefix_caching,
                                          reserve)
        self.watermark_blocks = int(config.watermark * num_gpu_blocks)
        self.groups: dict[str, SequenceGroup] = {}        # every unfinished request
        self.waiting: list[tuple[tuple, SequenceGroup]] = []   # heap; aborted entries skipped
        self.num_waiting = 0
        self.running: list[SequenceGroup] = []             # sorted by sort_key
        self.swapped: list[SequenceGroup] = []             # sorted by sort_key
        self.num_running_seqs = 0     # seq slots held by running groups (a group holds its max)
        self._pending_finished: list[int] = []   # seq ids the executors must drop next plan
        self._inflight: tuple[int, list[Sequence]] | None = None
        self._step_id = 0
        self._next_seq_id = 0
        self._next_order = 0
        self._stop_sets: dict[frozenset[int], frozenset[int]] = {}   # interned stop-id sets
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

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
        check_admission(req, cfg, self.block_manager.gpu.num_blocks)
        order = self._next_order
        self._next_order += 1
        key = (req.priority if cfg.policy == "priority" else 0, req.arrival_time, order)
        group = SequenceGroup(req, key)
        group.max_len = min(group.max_len, cfg.max_model_len)
        # NOTE: requests nearly all carry the same stop ids (the model's EOS): one shared set
        # stays in the cache, where one set per request is a cache miss per sampled token.
        stops = self._stop_sets.get(group.stop_ids)
        if stops is not None:
            group.stop_ids = stops
        elif len(self._stop_sets) < 1024:
            self._stop_sets[group.stop_ids] = group.stop_ids
        for _ in range(1 if group.is_beam else sp.n):
            group.seqs.append(self._new_seq(group, list(req.prompt_token_ids), L))
        if group.is_beam:
            group.beam = BeamSearch(sp, L, cfg.max_model_len)
        self.groups[req.request_id] = group
        heapq.heappush(self.waiting, (key, group))
        self.num_waiting += 1

    def _new_seq(self, group: SequenceGroup, tokens: list[int], prompt_len: int) -> Sequence:
        seq = Sequence(self._next_seq_id, group, tokens, prompt_len, group.next_sample_index)
        self._next_seq_id += 1
        group.next_sample_index += 1
        if group.sampling.logprobs is not None:
            seq.logprobs = []
        return seq

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Finish a request now and free everything it holds. Returns its final output
        (every unfinished seq with finish_reason=reason; for beam search, the n best beams so
        far, whole, since beams stream nothing), or None if the id is unknown."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        if group.is_beam:
            hyps = group.beam.best(max(1, group.sampling.n), group.seqs)
            deltas = [SeqDelta(i, h.token_ids, h.logprobs or [], reason, h.stop_token_id,
                               h.cumulative_logprob) for i, h in enumerate(hyps)]
        else:
            deltas = [SeqDelta(s.sample_index, [], finish_reason=reason,
                               cumulative_logprob=s.cumulative_logprob) for s in group.seqs]
        out = self._output(group, deltas)
        out.finished = True
        self._finish_group(group)
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
        self._finish_seq(seq)
        return self._output(group, [SeqDelta(seq.sample_index, [], finish_reason=reason,
                                             cumulative_logprob=seq.cumulative_logprob)])

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> StepPlan | None:
        """Build the next step. None when there is nothing to run (then seq ids to drop wait
        for the next plan). Raises RuntimeError if the previous plan was not update()d."""
        if self._inflight is not None:
            raise RuntimeError("schedule() called again before update() of the previous plan")
        step = _Step(self.config.max_num_batched_tokens, self._pending_finished)
        self._pending_finished = []
        if (self.config.policy == "priority" and self.running and self.waiting
                and not self.swapped):
            self._preempt_for_waiting(step)
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_swapped(step)
            if not self.swapped:
                self._schedule_waiting(step)
        if not step.seqs and not step.swap_out and not step.swap_in and not step.copy:
            self._pending_finished = step.finished
            return None
        return self._build_plan(step)

    def _schedule_running(self, step: _Step) -> None:
        running = self.running
        bm = self.block_manager
        caching = bm.enable_prefix_caching
        gpu = bm.gpu
        ref_count = gpu.ref_count
        num_tokens = gpu.num_tokens
        bs = self.block_size
        paged = not bm.reserve
        out = step.seqs
        scheduled = step.scheduled
        i = 0
        while i < len(running) and step.budget > 0:
            group = running[i]
            seqs = group.seqs
            if paged and len(seqs) == 1:
                # Fast path, the bulk of every step: one seq the executors know, decoding one
                # token into a block it owns alone, or into a fresh block. Same effect as
                # _schedule_group + _emit, in one visit of the seq.
                seq = seqs[0]
                c = seq.num_computed_tokens
                tokens = seq.token_ids
                sent = seq.num_tokens_sent
                if len(tokens) - c == 1 and sent >= 0:
                    table = seq.block_table
                    j = c // bs
                    if j < len(table):
                        block = table[j]
                        if ref_count[block] != 1:
                            block = -1              # shared: copy-on-write, the general path
                        else:
                            # gpu.fill(block, c - j * bs + 1), inline: one more slot filled
                            filled = c - j * bs + 1
                            if filled > num_tokens[block]:
                                gpu.num_filled_slots += filled - num_tokens[block]
                                num_tokens[block] = filled
                    elif gpu.free.num_free:
                        block = gpu.allocate()
                        gpu.fill(block, 1)
                        table.append(block)
                    else:
                        block = -1                  # out of blocks: the general path preempts
                    if block >= 0:
                        seq.num_scheduled_tokens = 1
                        out.append(seq)
                        if (caching and (c + 1) // bs > seq.num_cached_blocks
                                and not seq.cache_chain_broken):
                            bm.cache_computed_blocks(seq, c + 1)    # a block just filled
                        synced = seq.num_blocks_synced
                        n = len(table)
                        scheduled.append(ScheduledSeq(
                            seq.seq_id, c, 1, tokens[sent:],
                            -1 if synced == seq.num_blocks_sent else synced,
                            table[synced:] if synced < n else _NO_BLOCKS))
                        seq.num_tokens_sent = c + 1
                        seq.num_blocks_sent = seq.num_blocks_synced = n
                        step.budget -= 1
                        i += 1
                        continue
            if self._schedule_group(group, step, may_preempt=True):
                i += 1
            # else: the group preempted itself and left `running`

    def _schedule_swapped(self, step: _Step) -> None:
        bm = self.block_manager
        while self.swapped and step.budget > 0:
            group = self.swapped[0]
            if self.num_running_seqs + group.max_num_seqs > self.config.max_num_seqs:
                return
            work = self._group_work(group, step.budget)
            # The group's blocks come back as they were shared: CoW is counted on the CPU side.
            need = bm.num_unique_blocks(group.seqs) + self._blocks_needed(work, bm.cpu.ref_count)
            if bm.num_free_blocks - need < self._headroom(group):
                return
            self.swapped.pop(0)
            step.swap_in.extend(bm.swap_in(group.seqs))
            for s in group.seqs:
                s.status = RUNNING
            self._start_running(group)
            self._schedule_group(group, step, may_preempt=False)

    def _schedule_waiting(self, step: _Step) -> None:
        bm = self.block_manager
        bs = self.block_size
        waiting = self.waiting
        while waiting and step.budget > 0:
            group = waiting[0][1]
            if group.status != WAITING:          # aborted while queued
                heapq.heappop(waiting)
                continue
            if step.admit_below is not None and group.sort_key >= step.admit_below:
                return
            if self.num_running_seqs + group.max_num_seqs > self.config.max_num_seqs:
                return
            leader = group.seqs[0]
            cached, need = self._admission_need(group, step.budget)
            if bm.num_free_blocks - need < self._headroom(group):
                return
            heapq.heappop(waiting)
            self.num_waiting -= 1
            start = len(cached) * bs
            hit = min(start, group.prompt_len)   # a recomputed seq may hit its own output too
            if bm.enable_prefix_caching and group.prompt_logprobs is None:
                self.prefix_cache_queries += group.prompt_len
                self.prefix_cache_hits += hit
            if cached:
                bm.use_cached_prefix(leader, cached)
            if not group.first_output_sent:
                group.num_cached_tokens = hit
            for s in group.seqs:
                s.status = RUNNING
            self._start_running(group)
            self._schedule_group(group, step, may_preempt=False)

    def _admission_need(self, group: SequenceGroup, budget: int) -> tuple[list[int], int]:
        """(cached prefix blocks, free blocks it takes) to admit a waiting group with a first
        chunk of at most `budget` tokens."""
        bm = self.block_manager
        bs = self.block_size
        leader = group.seqs[0]
        multi = len(group.seqs) > 1
        target = group.fork_point if multi else len(leader.token_ids)
        cached = []
        if bm.enable_prefix_caching and group.prompt_logprobs is None:
            # At least one token is computed: its logits are what we sample from.
            cached = bm.find_cached_prefix(leader, min(target, len(leader.token_ids) - 1))
        start = len(cached) * bs
        if multi and start == target:
            # The fork happens right away: every seq computes from the fork point.
            need = 0
            for s in group.seqs:
                t = min(len(s.token_ids) - start, budget)
                budget -= t
                need += -(-(start + t) // bs) - len(cached)
            if bm.reserve:
                need = bm.reserve * len(group.seqs)
        else:
            t = min(target - start, budget)
            need = bm.reserve if bm.reserve else -(-(start + t) // bs) - len(cached)
        return cached, need + bm.num_revived(cached)

    def _waiting_head(self) -> SequenceGroup | None:
        """The next waiting group to admit (queue entries of aborted groups dropped)."""
        waiting = self.waiting
        while waiting and waiting[0][1].status != WAITING:
            heapq.heappop(waiting)
        return waiting[0][1] if waiting else None

    def _preempt_for_waiting(self, step: _Step) -> None:
        """Priority policy: when the most important waiting request cannot be admitted, preempt
        running groups of strictly lower priority (latest first) until it can, by recompute:
        their blocks are freed and they wait in the queue behind it.

        Only when the victims together make room; never for a request of equal or lower
        priority (so under equal priorities nothing changes: first come, first served); never
        while groups are swapped out (they resume before any admission). Victims are chosen
        before anything is scheduled in this step.
        """
        head = self._waiting_head()
        running = self.running
        if head is None or running[-1].priority <= head.priority:
            return
        bm = self.block_manager
        cfg = self.config
        seat_short = self.num_running_seqs + head.max_num_seqs - cfg.max_num_seqs
        # Its first chunk shares the step with the decodes of those who stay.
        budget = max(1, cfg.max_num_batched_tokens - self.num_running_seqs)
        _, need = self._admission_need(head, budget)
        block_short = need + self._headroom(head) - bm.num_free_blocks
        if seat_short <= 0 and block_short <= 0:
            return                                   # it fits: admitted as usual
        ref_count = bm.gpu.ref_count
        victims: list[SequenceGroup] = []
        for group in reversed(running):
            if group.priority <= head.priority or (seat_short <= 0 and block_short <= 0):
                break
            victims.append(group)
            seat_short -= group.max_num_seqs
            # Blocks it frees: those no other group maps (a shared cached prefix stays).
            refs: dict[int, int] = {}
            for seq in group.seqs:
                for b in seq.block_table:
                    refs[b] = refs.get(b, 0) + 1
            block_short -= sum(1 for b, r in refs.items() if ref_count[b] == r)
            # Fewer running seqs: less headroom is kept for their growth.
            block_short -= int(cfg.growth_reserve * group.max_num_seqs)
        if seat_short > 0 or block_short > 0:
            return                   # even all of them would not make room: preempt nobody
        preempted = step.preempted
        for group in victims:
            self._preempt(group, step, mode="recompute")
        step.preempted = preempted   # these were for admission: the step goes on to admit
        step.admit_below = min(g.sort_key for g in victims)

    def _headroom(self, group: SequenceGroup) -> int:
        """Free blocks that admitting (or swapping in) `group` must leave for the running seqs
        and its own to grow.

        NOTE: without it, a group preempted for lack of blocks is readmitted as soon as its
        prompt fits, grows, and is preempted again: recompute thrash. Reserving about one
        block per seq lets them all reach their next block first. Nothing running: no
        headroom, so a request that fits the empty pool always starts (no deadlock).
        """
        if not self.running or self.block_manager.reserve:
            return 0                 # (the contiguous baseline reserves everything up front)
        seqs = self.num_running_seqs + group.max_num_seqs
        return self.watermark_blocks + int(self.config.growth_reserve * seqs)

    def _start_running(self, group: SequenceGroup) -> None:
        group.status = RUNNING
        self.num_running_seqs += group.max_num_seqs
        running = self.running
        if not running or running[-1].sort_key < group.sort_key:
            running.append(group)
        else:
            insort(running, group, key=_sort_key)

    def _group_work(self, group: SequenceGroup, budget: int) -> list[tuple[Sequence, int]]:
        """(seq, tokens) to run this step within `budget`. A group not yet forked runs only its
        leader, up to the fork point. A beam group samples all its beams in the same step or
        none (beam selection needs every beam's candidates)."""
        seqs = group.seqs
        if len(seqs) == 1:
            seq = seqs[0]
            t = len(seq.token_ids) - seq.num_computed_tokens
            if t > budget:
                t = budget
            return [(seq, t)] if t > 0 else []
        if not group.forked:
            leader = seqs[0]
            t = min(group.fork_point - leader.num_computed_tokens, budget)
            return [(leader, t)] if t > 0 else []
        work = []
        all_sample = True
        for seq in seqs:
            left = len(seq.token_ids) - seq.num_computed_tokens
            t = left if left < budget else budget
            if t < left:
                all_sample = False
            if t > 0:
                work.append((seq, t))
                budget -= t
        if group.is_beam and not all_sample:
            work = [(s, t - (1 if s.num_computed_tokens + t == len(s.token_ids) else 0))
                    for s, t in work]
            work = [(s, t) for s, t in work if t > 0]
        return work

    def _blocks_needed(self, work: list[tuple[Sequence, int]],
                       ref_count: list[int] | None = None) -> int:
        """Free blocks that allocating `work` takes: new blocks plus exact copy-on-writes.
        `ref_count`: the pool the tables point into (GPU unless swapped out)."""
        bm = self.block_manager
        if bm.reserve:
            return sum(bm.reserve for s, _ in work if not s.block_table)
        bs = self.block_size
        if ref_count is None:
            ref_count = bm.gpu.ref_count
        need = 0
        writers: dict[int, int] | None = None
        for seq, t in work:
            table = seq.block_table
            c = seq.num_computed_tokens
            n = -(-(c + t) // bs) - len(table)
            if n > 0:
                need += n
            j = c // bs
            if j < len(table) and ref_count[table[j]] > 1:
                if writers is None:
                    writers = {}
                writers[table[j]] = writers.get(table[j], 0) + 1
        if writers:
            # A block shared r ways and written by w of them is copied min(w, r - 1) times:
            # the last sharer to write finds it unshared and writes in place.
            for b, w in writers.items():
                need += min(w, ref_count[b] - 1)
        return need

    def _ensure_free(self, group: SequenceGroup, need: int, step: _Step,
                     may_preempt: bool) -> bool:
        """Make `need` blocks free by preempting later running groups. False if `group` itself
        had to go (or, when it may not preempt, if the blocks are not there)."""
        bm = self.block_manager
        while bm.num_free_blocks < need:
            if not may_preempt:
                return False
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is group:
                return False
        return True

    def _schedule_group(self, group: SequenceGroup, step: _Step, may_preempt: bool) -> bool:
        """Schedule one running group's work, preempting others for blocks if needed.
        Returns False if the group was preempted itself."""
        bm = self.block_manager
        if group.needs_fork and group.seqs[0].num_computed_tokens >= group.fork_point:
            if bm.reserve and not self._ensure_free(
                    group, bm.reserve * (len(group.seqs) - 1), step, may_preempt):
                return group.status == RUNNING
            self._fork_group(group, step)
        work = self._group_work(group, step.budget)
        if not work:
            return True
        need = self._blocks_needed(work)
        if need and not self._ensure_free(group, need, step, may_preempt):
            return group.status == RUNNING
        for seq, t in work:
            copies = bm.allocate_slots(seq, t)
            if copies:
                step.copy.extend(copies)
            self._emit(seq, t, step)
        return True

    def _emit(self, seq: Sequence, t: int, step: _Step) -> None:
        """Put `seq`, its slots allocated, into the step with `t` tokens, and write its plan
        entry now: the seq whole if the executors do not know it, else what changed since
        they last saw it (the token and block-table diffs). Blocks this step fills are
        registered in the prefix cache now, so that a prompt admitted later in this same
        step maps them instead of computing them again (see cache_computed_blocks).

        NOTE: the entry is built here, not in a pass over the step at the end, so that each
        seq's state is visited once per schedule(): at 1,000 running seqs that state no longer
        fits in a core's cache and every extra pass over it is a pass of cache misses. Nothing
        later in the same schedule() changes a scheduled seq (victims of preemption are always
        groups not yet scheduled in this step).
        """
        seq.num_scheduled_tokens = t
        step.seqs.append(seq)
        step.budget -= t
        if (seq.num_computed_tokens + t) // self.block_size > seq.num_cached_blocks:
            self.block_manager.cache_computed_blocks(seq, seq.num_computed_tokens + t)
        tokens = seq.token_ids
        table = seq.block_table
        if seq.num_tokens_sent < 0:
            g = seq.group
            step.new_seqs.append(NewSeq(seq.seq_id, g.request_id, list(tokens), seq.prompt_len,
                                        list(table), g.sampling, seq.sample_index))
            step.scheduled.append(ScheduledSeq(seq.seq_id, seq.num_computed_tokens, t))
        else:
            synced = seq.num_blocks_synced
            step.scheduled.append(ScheduledSeq(
                seq.seq_id, seq.num_computed_tokens, t, tokens[seq.num_tokens_sent:],
                -1 if synced == seq.num_blocks_sent else synced,
                table[synced:] if synced < len(table) else _NO_BLOCKS))
        seq.num_tokens_sent = len(tokens)
        seq.num_blocks_sent = seq.num_blocks_synced = len(table)

    def _fork_group(self, group: SequenceGroup, step: _Step) -> None:
        """The leader computed the shared prefix: every other seq now maps its blocks."""
        leader = group.seqs[0]
        for seq in group.seqs[1:]:
            step.copy.extend(self.block_manager.fork(leader, seq))
        group.forked = True

    def _preempt(self, group: SequenceGroup, step: _Step, mode: str | None = None) -> None:
        """Take a running group off the GPU: swap its blocks out, or drop them to recompute."""
        bm = self.block_manager
        mode = mode or self.config.preemption_mode
        if mode == "auto":
            mode = "swap" if len(group.seqs) > 1 else "recompute"
        if mode == "swap" and not bm.can_swap_out(group.seqs):
            mode = "recompute"   # the CPU pool is full: recomputing is always possible
        if self.running[-1] is group:
            self.running.pop()
        else:
            self.running.remove(group)
        self.num_running_seqs -= group.max_num_seqs
        self.num_preemptions += 1
        step.preempted = True
        if mode == "swap":
            step.swap_out.extend(bm.swap_out(group.seqs))
            for seq in group.seqs:
                seq.status = SWAPPED
            group.status = SWAPPED
            insort(self.swapped, group, key=_sort_key)
            return
        for seq in group.seqs:
            bm.free(seq)
            if seq.num_tokens_sent >= 0:
                step.finished.append(seq.seq_id)
            seq.forget_executor_state()
            seq.num_computed_tokens = 0
            seq.status = WAITING
        group.forked = False
        group.status = WAITING
        if group.prompt_logprobs is not None and not group.first_output_sent:
            group.prompt_logprobs = []      # they are computed again
        heapq.heappush(self.waiting, (group.sort_key, group))
        self.num_waiting += 1

    def _build_plan(self, step: _Step) -> StepPlan:
        self._step_id += 1
        self._inflight = (self._step_id, step.seqs)
        return StepPlan(self._step_id, step.new_seqs, step.scheduled, step.swap_out,
                        step.swap_in, step.copy, step.finished)

    # ------------------------------------------------------------------ update
    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Apply a step's sampled tokens. Returns one RequestOutput per request with news
        (new tokens, a finish). A result carrying `error` fails every request in the step."""
        if self._inflight is None or self._inflight[0] != plan.step_id:
            raise ValueError(f"update() for step {plan.step_id}, but the plan in flight is "
                             f"{self._inflight[0] if self._inflight else None}")
        if result.step_id != plan.step_id:
            raise ValueError(f"the result of step {result.step_id} does not answer step "
                             f"{plan.step_id}")
        seqs = self._inflight[1]
        self._inflight = None
        if result.error is not None:
            return self._fail_step(seqs, result.error)
        # NOTE: one pass over the step's seqs, each visited once: advance its computed tokens,
        # then apply its sample. (Two passes, one over the seqs and one over the samples,
        # cost a second round of cache misses per seq once the batch outgrows the cache.)
        # Executors return samples in plan order as a rule, so a cursor finds them; anything
        # out of order is looked up by id. A duplicate sample for one seq is ignored, as is a
        # sample for a seq that was not in this step.
        samples = result.samples
        num_samples = len(samples)
        k = 0
        by_id: dict[int, SeqSample] | None = None
        append_token = self._append_token
        outs: list[RequestOutput] = []
        grouped: dict[str, int] = {}     # request id -> its output in outs (groups of several)
        beam_steps: dict[str, list] = {}
        prompt_done = 0
        num_ended = 0                        # chunks that reached their seq's end: must sample
        num_sampled = 0
        any_finished = False
        for seq in seqs:
            if seq.status != RUNNING:        # aborted or finished while in flight
                continue
            c = seq.num_computed_tokens
            t = seq.num_scheduled_tokens
            seq.num_computed_tokens = c + t
            seq.num_scheduled_tokens = 0
            if c < seq.prompt_len:
                prompt_done += min(c + t, seq.prompt_len) - c
            tokens = seq.token_ids
            at_end = c + t == len(tokens)
            if at_end:
                num_ended += 1
            if k < num_samples and samples[k].seq_id == seq.seq_id:
                s = samples[k]
                k += 1
            else:
                if by_id is None:
                    by_id = {}
                    for x in samples:
                        by_id.setdefault(x.seq_id, x)
                s = by_id.get(seq.seq_id)
                if s is None:
                    continue
            group = seq.group
            if s.prompt_logprobs and group.prompt_logprobs is not None and seq is group.seqs[0]:
                room = group.prompt_len - 1 - len(group.prompt_logprobs)
                if room > 0:
                    group.prompt_logprobs.extend(s.prompt_logprobs[:room])
            token = s.token_id
            if token < 0 or not at_end:
                continue
            if group.is_beam:
                beam_steps.setdefault(group.request_id, []).append((seq, s.top))
                continue
            num_sampled += 1
            if seq.logprobs is None and token not in group.stop_ids:
                # The common case, inline: _append_token without logprobs or a stop.
                cum = seq.cumulative_logprob = seq.cumulative_logprob + s.logprob
                tokens.append(token)
                if len(tokens) < group.max_len:
                    delta = SeqDelta(seq.sample_index, [token], _NO_LOGPROBS, None, None, cum)
                else:
                    seq.finish_reason = "length"
                    delta = SeqDelta(seq.sample_index, [token], _NO_LOGPROBS, "length", None,
                                     cum)
            else:
                delta = append_token(seq, group, token, s.logprob, s.top)
            i = grouped.get(group.request_id) if group.max_num_seqs > 1 else None
            if i is not None:
                out = outs[i]
                out.seqs.append(delta)
            else:
                if group.max_num_seqs > 1:
                    grouped[group.request_id] = len(outs)
                if group.first_output_sent:
                    out = RequestOutput(group.request_id, [delta], False, group.prompt_len,
                                        group.num_cached_tokens)
                else:
                    out = self._output(group, [delta])
                outs.append(out)
            if delta.finish_reason is not None:
                self._finish_seq(seq)
                if not group.seqs:
                    out.finished = True
                    self._finish_group(group, prune_running=False)
                    any_finished = True
        self.prompt_tokens_total += prompt_done
        for rid, beams in beam_steps.items():
            num_sampled += len(beams)
            group = self.groups[rid]
            out = self._beam_step(group, beams)
            if out is not None:
                grouped[rid] = len(outs)
                outs.append(out)
                any_finished = True
        self.generation_tokens_total += num_sampled
        for seq in seqs if num_sampled < num_ended else ():
            # A chunk that reached the end of its seq must have sampled (the contract); a seq
            # left without a token would never be scheduled again, so its request fails.
            if seq.status == RUNNING and seq.num_computed_tokens == len(seq.token_ids):
                group = seq.group
                out = self.abort_request(group.request_id, "error")
                out.error = (f"the executor returned no token for sequence {seq.seq_id}: "
                             "the request was stopped, please retry it")
                out.error_code = 500
                i = grouped.get(group.request_id)
                if i is None:
                    outs.append(out)
                else:
                    outs[i] = out            # replaces the news of its other seqs
        if any_finished:
            self.running = [g for g in self.running if g.status == RUNNING]
        return outs

    @staticmethod
    def _append_token(seq: Sequence, group: SequenceGroup, token: int, logprob: float,
                      top: list) -> SeqDelta:
        """Apply one sampled token: a stop token (once min_tokens are out) finishes the seq
        without joining its tokens; reaching max_tokens / max_model_len finishes it "length"."""
        seq.cumulative_logprob += logprob
        tokens = seq.token_ids
        if token in group.stop_ids and len(tokens) >= group.min_len:
            seq.finish_reason = "stop"
            seq.stop_token_id = token
            # the stop token's own logprob rides along (clients score it, as vLLM reports it)
            stop_lp = (_NO_LOGPROBS if seq.logprobs is None else
                       [TokenLogprob(token, logprob, top[:group.sampling.logprobs])])
            return SeqDelta(seq.sample_index, [], stop_lp, "stop", token,
                            seq.cumulative_logprob)
        tokens.append(token)
        reason = None
        if len(tokens) >= group.max_len:
            reason = seq.finish_reason = "length"
        if seq.logprobs is None:
            return SeqDelta(seq.sample_index, [token], _NO_LOGPROBS, reason, None,
                            seq.cumulative_logprob)
        lp = TokenLogprob(token, logprob, top[:group.sampling.logprobs])
        seq.logprobs.append(lp)
        return SeqDelta(seq.sample_index, [token], [lp], reason, None, seq.cumulative_logprob)

    def _beam_step(self, group: SequenceGroup, beams: list) -> RequestOutput | None:
        """Select the next beams; fork, extend and free seqs. Returns the final output when
        the search is over, else None (beam requests report only when finished)."""
        search: BeamSearch = group.beam
        chosen, done = search.step(beams)
        if done:
            hyps = search.best(max(1, group.sampling.n))
            deltas = [SeqDelta(i, h.token_ids, h.logprobs or [], h.finish_reason,
                               h.stop_token_id, h.cumulative_logprob)
                      for i, h in enumerate(hyps)]
            out = self._output(group, deltas)
            out.finished = True
            self._finish_group(group, prune_running=False)
            return out
        by_parent: dict[int, list] = {}
        for cand in chosen:
            by_parent.setdefault(cand.parent.seq_id, []).append(cand)
        kept = []
        for seq in group.seqs:
            if seq.seq_id not in by_parent:
                self._release_seq(seq)       # a beam no candidate extends
            else:
                kept.append(seq)
        children = []
        for seq in kept:
            cands = by_parent[seq.seq_id]
            for cand in cands[1:]:
                child = self._new_seq(group, seq.token_ids + [cand.token_id], seq.prompt_len)
                self.block_manager.fork(seq, child)
                child.status = RUNNING
                child.cumulative_logprob = cand.cumulative_logprob
                if seq.logprobs is not None:
                    child.logprobs = seq.logprobs + [search.token_logprob(cand)]
                children.append(child)
            first = cands[0]
            seq.token_ids.append(first.token_id)
            seq.cumulative_logprob = first.cumulative_logprob
            if seq.logprobs is not None:
                seq.logprobs.append(search.token_logprob(first))
        group.seqs = kept + children
        group.forked = True
        return None

    def _output(self, group: SequenceGroup, deltas: list[SeqDelta]) -> RequestOutput:
        out = RequestOutput(group.request_id, deltas, False, group.prompt_len,
                            group.num_cached_tokens)
        if not group.first_output_sent:
            group.first_output_sent = True
            if group.prompt_logprobs is not None:
                out.prompt_logprobs = [None, *group.prompt_logprobs]
        return out

    def _uncache_step_blocks(self, seq: Sequence) -> None:
        """Take back the prefix-cache entries of the blocks seq's in-flight chunk fills: they
        were registered when the step was scheduled, and the step failed or may fail."""
        if seq.num_scheduled_tokens and self.block_manager.enable_prefix_caching:
            c = seq.num_computed_tokens
            self.block_manager.uncache_blocks(seq, c // self.block_size,
                                              (c + seq.num_scheduled_tokens) // self.block_size)

    def _release_seq(self, seq: Sequence) -> None:
        """Free a seq's blocks and tell the executors to drop it with the next plan."""
        if self._inflight is not None:
            self._uncache_step_blocks(seq)      # aborted while its step runs
        self.block_manager.free(seq)
        if seq.num_tokens_sent >= 0:
            self._pending_finished.append(seq.seq_id)
        seq.status = FINISHED

    def _finish_seq(self, seq: Sequence) -> None:
        self._release_seq(seq)
        seq.group.seqs.remove(seq)

    def _finish_group(self, group: SequenceGroup, prune_running: bool = True) -> None:
        """Release everything a request holds, whatever its state."""
        status = group.status
        for seq in group.seqs:
            self._release_seq(seq)
        group.seqs = []
        if status == RUNNING:
            self.num_running_seqs -= group.max_num_seqs
            if prune_running:
                self.running.remove(group)
        elif status == SWAPPED:
            self.swapped.remove(group)
        elif status == WAITING:
            self.num_waiting -= 1       # its heap entry is skipped when reached
        group.status = FINISHED
        self.groups.pop(group.request_id, None)

    def _fail_step(self, seqs: list[Sequence], error: str) -> list[RequestOutput]:
        for seq in seqs:
            if seq.status == RUNNING:
                self._uncache_step_blocks(seq)
        outputs = []
        for group in {s.group.request_id: s.group for s in seqs}.values():
            if group.status == FINISHED:
                continue
            out = self.abort_request(group.request_id, "error")
            out.error = f"the model step failed: {error}"
            out.error_code = 500
            outputs.append(out)
        return outputs

    # ------------------------------------------------------------------ figures
    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        gpu = bm.gpu
        return SchedulerStats(
            num_running=len(self.running), num_waiting=self.num_waiting,
            num_swapped=len(self.swapped), num_running_seqs=sum(len(g.seqs) for g in self.running),
            gpu_blocks_used=gpu.num_used, gpu_blocks_free=gpu.num_free,
            gpu_blocks_cached=len(gpu.cached), gpu_blocks_total=gpu.num_blocks,
            gpu_blocks_logical=gpu.num_refs,
            cpu_blocks_used=bm.cpu.num_used, cpu_blocks_total=bm.cpu.num_blocks,
            token_slots_allocated=gpu.num_used * self.block_size,
            token_slots_filled=gpu.num_filled_slots,
            num_preemptions=self.num_preemptions,
            swapped_out_blocks_total=bm.swapped_out_blocks_total,
            swapped_in_blocks_total=bm.swapped_in_blocks_total,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total)
