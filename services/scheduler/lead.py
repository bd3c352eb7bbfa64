"""The running queue's lead as columns: a step's steady decodes without a Python object per seq.

Most of a step is requests of one sequence decoding one token into a block of their own. Walked
as objects (group, seq, the tail of its token list and of its block table, the pool's count
for that block) they cost more per seq at 1,024 seqs than at 256, whatever the code does with
them: the objects no longer stay in the caches (docs/overhead.md, "a floor that every
per-object design pays"). So the lead of `running`, its longest prefix of such groups, keeps
what a decode reads and writes in slot-indexed columns, and a step's work over the lead is a
few array operations:

    order        the lead's slots in queue order: running[:len(order)] are their groups
    per slot     seq_id computed scheduled length last_token cum min_len max_len
                 stops[STOPS] table_len last_block pend[PENDING] npend

A lead seq's Sequence stays a true view: its hot fields are properties over these columns
(sequence.py) and its token list is joined with the tokens sampled since (`pend`) whenever it
is read, or once PENDING are waiting. Python touches a lead seq only when it opens or fills
a block (1 step in block_size), finishes, or leaves the lead.

The lead is what the per-seq decode pass (BlockManager.decode_slots, PlanBuilder.add_decodes)
would do for the same groups, in the same order: the same rows, blocks and prefix-cache
registrations (tests/scheduler/test_simulation.py runs both). It stops where a group is not
such a decode (a prefill, n > 1, beams, logprobs, a grammar); that group and every one after
it take the per-seq path, and a group inserted into the lead's span cuts it there.
"""
from __future__ import annotations

from bisect import bisect
from collections import deque
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from services.scheduler.plan import _NO_BLOCKS
from services.scheduler.sequence import Sequence, SequenceGroup

if TYPE_CHECKING:
    from services.scheduler.block_manager import BlockManager
    from services.scheduler.plan import PlanBuilder

STOPS = 4         # stop ids a lead seq may have (more: it takes the per-seq path)
PENDING = 16      # sampled tokens kept in columns before they join the seq's list
_INT_COLUMNS = ("seq_id", "computed", "scheduled", "length", "last_token",
                "min_len", "max_len", "table_len", "last_block", "npend")
_sort_key = attrgetter("sort_key")


class Lead:
    """The lead of one scheduler's running queue (see the module's docstring)."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.bm = block_manager
        self.block_size = block_manager.block_size
        # The contiguous baseline writes into a region reserved up front, not the table's
        # last block: its decodes keep the per-seq path.
        self.enabled = block_manager.grows_on_demand
        self.cap = 0
        self.seqs: list[Sequence | None] = []
        self.groups: list[SequenceGroup | None] = []
        self.free: deque[int] = deque()     # slots, oldest freed first (see StepOutputs)
        self.order = np.empty(0, np.int64)
        self._grow(64)

    def _grow(self, cap: int) -> None:
        old = self.cap
        for name in _INT_COLUMNS:
            self._widen(name, (cap,), np.int64, old)
        self._widen("cum", (cap,), np.float64, old)
        self._widen("stops", (cap, STOPS), np.int64, old)
        self._widen("pend", (cap, PENDING), np.int64, old)
        self.seq_id[old:] = -1
        self.seqs += [None] * (cap - old)
        self.groups += [None] * (cap - old)
        self.free.extend(range(old, cap))
        self.cap = cap

    def _widen(self, name: str, shape: tuple, dtype, old: int) -> None:
        column = np.zeros(shape, dtype)
        if old:
            column[:old] = getattr(self, name)
        setattr(self, name, column)

    def __len__(self) -> int:
        return len(self.order)

    # ------------------------------------------------------------ joining and leaving
    def joins(self, group: SequenceGroup) -> bool:
        """Whether a running group is one seq whose next step is a steady decode: the
        executors hold all its tokens but the last sampled one and its whole table, and
        the token goes into its last block, which it maps alone, or into a new one."""
        if (len(group.seqs) != 1 or group.max_num_seqs != 1 or group.is_beam
                or not group.first_output_sent or len(group.stop_ids) > STOPS):
            return False
        seq = group.seqs[0]
        if seq.matcher is not None or seq.logprobs is not None or seq.lead is not None:
            return False
        c = seq.num_computed_tokens
        table = seq.block_table
        j = c // self.block_size
        return (len(seq.token_ids) == c + 1 == seq.num_tokens_sent + 1
                and seq.num_scheduled_tokens == 0
                and seq.num_blocks_synced == len(table) == seq.num_blocks_sent
                and (j == len(table) or j == len(table) - 1
                     and self.bm.gpu.ref_count[table[j]] == 1))

    def extend(self, running: list[SequenceGroup]) -> None:
        """Take in the groups after the lead that join it, in order, up to the first that
        does not."""
        if not self.enabled:
            return
        m = len(self.order)
        slots = []
        while m < len(running) and self.joins(running[m]):
            slots.append(self._take(running[m]))
            m += 1
        if slots:
            self.order = np.concatenate((self.order, np.array(slots, np.int64)))

    def _take(self, group: SequenceGroup) -> int:
        if not self.free:
            self._grow(2 * self.cap)
        s = self.free.popleft()
        seq = group.seqs[0]
        tokens = seq.token_ids
        table = seq.block_table
        self.seq_id[s] = seq.seq_id
        self.computed[s] = seq._computed
        self.scheduled[s] = 0
        self.length[s] = len(tokens)
        self.last_token[s] = tokens[-1]
        self.cum[s] = seq._cum
        self.min_len[s] = group.min_len
        self.max_len[s] = group.max_len
        self.stops[s] = -1
        self.stops[s, :len(group.stop_ids)] = sorted(group.stop_ids)
        self.table_len[s] = len(table)
        self.last_block[s] = table[-1] if table else -1
        self.npend[s] = 0
        self.seqs[s] = seq
        self.groups[s] = group
        seq.lead, seq.slot = self, s
        return s

    def _release(self, s: int) -> None:
        """Slot `s` leaves the lead: its seq's fields go back to the seq. (seqs[s] and
        groups[s] stay until the slot is taken again: a step's news may still name it.)"""
        seq = self.seqs[s]
        if self.npend[s]:
            self.flush(s)
        seq.lead = None
        seq._computed = int(self.computed[s])
        seq._scheduled = int(self.scheduled[s])
        seq._sent = int(self.computed[s] + self.scheduled[s])
        seq._cum = float(self.cum[s])
        self.seq_id[s] = -1
        self.free.append(s)

    def cut(self, at: int) -> None:
        """The groups from queue position `at` on leave the lead (the per-seq path takes
        them, or a group is inserted there)."""
        if at < len(self.order):
            for s in self.order[at:].tolist():
                self._release(s)
            self.order = self.order[:at]

    def enter(self, running: list[SequenceGroup], group: SequenceGroup) -> None:
        """Put a group into the running queue, in queue order (cutting the lead there)."""
        if not running or running[-1].sort_key < group.sort_key:
            running.append(group)
        else:
            at = bisect(running, group.sort_key, key=_sort_key)
            self.cut(at)
            running.insert(at, group)

    def leave(self, running: list[SequenceGroup], group: SequenceGroup) -> None:
        """Take a group out of the running queue."""
        seq = group.seqs[0] if group.seqs else None
        if seq is not None and seq.lead is self:
            self.remove(running, [seq.slot])
        elif running[-1] is group:
            running.pop()
        else:
            del running[running.index(group, len(self.order))]

    def remove(self, running: list[SequenceGroup], slots: list[int]) -> None:
        """These lead slots' groups leave the running queue (finished, aborted, preempted)."""
        gone = np.isin(self.order, slots)
        for p in np.flatnonzero(gone)[::-1].tolist():
            del running[p]
        self.order = self.order[~gone]
        for s in slots:
            self._release(s)

    def flush(self, s: int) -> None:
        """Join the tokens sampled since into the seq's list."""
        n = int(self.npend[s])
        self.seqs[s]._tokens.extend(self.pend[s, :n].tolist())
        self.npend[s] = 0

    # ------------------------------------------------------------ a step
    def schedule(self, step: PlanBuilder, ahead: list | None = None) -> int:
        """Put the lead's decodes into `step`, in queue order, within its budget and the free
        blocks (as decode_slots + add_decodes would). Returns how many were scheduled.

        `ahead` (a list): the step is planned while the one before it runs (async scheduling,
        ahead.py): each seq's input is the token that step samples, unknown yet, so its row
        carries the placeholder -1 (shared/messages.py, StepPlan), a block it fills goes
        into `ahead` as (seq, tokens) to be registered in the prefix cache once that token
        is known, instead of now, and seqs that reach their length with that step get no
        row. Returns the rows written then, which need not be a prefix of the lead."""
        k = min(len(self.order), step.budget)
        if k <= 0:
            return 0
        bs = self.block_size
        bm = self.bm
        gpu = bm.gpu
        idx = self.order[:k]
        if ahead is None:
            c = self.computed[idx]
        else:
            # A seq that reaches its length with the step in flight ends with it: no row.
            idx = idx[self.length[idx] + 1 < self.max_len[idx]]
            k = len(idx)
            if not k:
                return 0
            c = self.computed[idx] + self.scheduled[idx]
        pos = c % bs
        new = c // bs == self.table_len[idx]
        blocks = [_NO_BLOCKS] * k
        # Python only for the seqs that open a block or fill one (1 step in block_size).
        edge = np.flatnonzero(new | (pos == bs - 1))
        if len(edge):
            seqs = self.seqs
            opened = []
            for p, s, opens, c_p in zip(edge.tolist(), idx[edge].tolist(), new[edge].tolist(),
                                        c[edge].tolist()):
                seq = seqs[s]
                if opens:
                    if not gpu.free.num_free:
                        k = p
                        break
                    b = gpu.allocate()
                    table = seq.block_table
                    table.append(b)
                    seq.num_blocks_sent = seq.num_blocks_synced = len(table)
                    opened.append((s, b))
                    blocks[p] = [b]
                if (c_p + 1) % bs == 0:
                    if ahead is None:
                        bm.cache_computed_blocks(seq, c_p + 1)
                    else:
                        ahead.append((seq, c_p + 1))
            if opened:
                s_opened, b_opened = zip(*opened)
                self.table_len[list(s_opened)] += 1
                self.last_block[list(s_opened)] = b_opened
        if k < len(idx):
            idx, c, pos, blocks = idx[:k], c[:k], pos[:k], blocks[:k]
        if not k:
            return 0
        last = self.last_block[idx]
        filled = gpu.num_tokens_np[last]
        n = pos + 1
        gpu.num_filled_slots += int((n - filled).sum())
        gpu.num_tokens_np[last] = n
        if ahead is None:
            self.scheduled[idx] = 1
            tokens = self.last_token[idx].tolist()
        else:
            self.scheduled[idx] += 1
            tokens = [-1] * k
        step.add_lead(idx, self.seq_id[idx], c.tolist(), tokens, blocks)
        return k

    def apply(self, slots: np.ndarray, seq_ids: np.ndarray, token_ids: list[int],
              logprobs: list[float]) -> tuple:
        """Apply the sampled tokens of the lead's rows (the plan's first rows): the finish
        rules of outputs.apply_result, on columns. Returns (the slots still in the lead,
        their tokens, their cumulative logprobs, which of them stop, which reach their
        length, and the rows whose seqs left the lead since: (seq, token, logprob) each, for
        the per-seq path: aborted, or cut from the lead while the step ran)."""
        k = len(slots)
        tokens = np.array(token_ids[:k], np.int64)
        lps = np.array(logprobs[:k], np.float64)
        live = self.seq_id[slots] == seq_ids
        left = []
        if not live.all():
            out = ~live
            left = [(self.seqs[s], t, lp) for s, t, lp in zip(
                slots[out].tolist(), tokens[out].tolist(), lps[out].tolist())]
            slots, tokens, lps = slots[live], tokens[live], lps[live]
        self.computed[slots] += 1
        self.scheduled[slots] -= 1        # 1 left when the next step was planned ahead
        cum = self.cum[slots] + lps
        self.cum[slots] = cum
        length = self.length[slots]
        # A stop token (once min_tokens are out) ends the seq without joining it; reaching
        # max_tokens or max_model_len ends it "length".
        stop = (self.stops[slots] == tokens[:, None]).any(1) & (length >= self.min_len[slots])
        go = ~stop
        kept = slots[go]
        kept_tokens = tokens[go]
        npend = self.npend[kept]
        self.pend[kept, npend] = kept_tokens
        self.npend[kept] = npend + 1
        self.length[kept] = length[go] + 1
        self.last_token[kept] = kept_tokens
        for s in kept[npend + 1 == PENDING].tolist():
            self.flush(s)
        long = np.zeros(len(slots), bool)
        long[go] = length[go] + 1 >= self.max_len[kept]
        return slots, tokens, cum, stop, long, left

    def seqs_of(self, slots: np.ndarray) -> list[Sequence]:
        """The seqs of the step in flight's lead rows (whether still in the lead or not: a
        slot is taken again only by the next step's extend)."""
        return [self.seqs[s] for s in slots.tolist()]
