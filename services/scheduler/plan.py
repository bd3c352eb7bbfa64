"""The plan builder: what the executors hold of each sequence, and the StepPlan under way.

The executors keep every sequence they were sent (its tokens and block table) until a plan
drops it, so a plan carries only what changed. Each `Sequence` mirrors their copy:

    num_tokens_sent     tokens they hold (-1: they do not know the seq; send it whole)
    num_blocks_sent     length of their block table
    num_blocks_synced   leading entries of their table equal to ours (a copy-on-write or a
                        swap-in replaces entries: from there on, theirs are stale)

`add` is the one way a sequence enters a step, whatever path scheduled it: it registers the
blocks the step fills in the prefix cache, writes the sequence's row (its diffs against the
mirror) and moves the mirror forward. Rows go in the order the executors run them
(shared/messages.py, StepPlan): decodes that sample, then other rows that sample, then
prefill chunks that stop short of their sequence's end.
"""
from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.constrained import add_bitmasks
from services.scheduler.sequence import Sequence
from shared.messages import NewSeq, StepPlan

# NOTE: most rows carry no new blocks and most prefill chunks no appended tokens; they share
# one empty list each instead of allocating one per row per step. Nothing appends to a plan's
# lists after it is built (the wire carries copies): never append to these.
_NO_BLOCKS: list[int] = []
_NO_TOKENS: list[int] = []


def drop_from_executors(seq: Sequence, finished_seq_ids: list[int]) -> None:
    """The executors must forget `seq` (finished, or preempted to recompute): its id goes
    into the next plan's finished_seq_ids if they know it; a later plan sends it whole."""
    if seq.num_tokens_sent >= 0:
        finished_seq_ids.append(seq.seq_id)
    seq.num_tokens_sent = -1
    seq.num_blocks_sent = 0
    seq.num_blocks_synced = 0


class PlanBuilder:
    """One step's plan, built as sequences are scheduled; `budget` is the tokens left."""

    __slots__ = ("block_manager", "block_size", "budget", "decode_rows", "decode_tokens",
                 "other_rows", "new_seqs", "swap_out", "swap_in", "copy", "finished_seq_ids",
                 "swapped_out_seqs", "constrained")

    def __init__(self, block_manager: BlockManager, budget: int,
                 finished_seq_ids: list[int]) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.budget = budget
        # Rows as tuples, turned into the plan's columns by build() (one C-level transpose
        # instead of six list appends per row):
        #   decode_rows  (seq, seq_id, computed, num_append, keep, blocks): one token, sampled;
        #                their appended tokens go straight into decode_tokens (row order)
        #   other_rows   (samples, seq, seq_id, computed, tokens, num_append, keep, blocks,
        #                 appended tokens)
        self.decode_rows: list[tuple] = []
        self.decode_tokens: list[int] = []
        self.other_rows: list[tuple] = []
        self.new_seqs: list[NewSeq] = []
        self.swap_out: list[list[int]] = []
        self.swap_in: list[list[int]] = []
        self.copy: list[list[int]] = []
        self.finished_seq_ids = finished_seq_ids
        self.swapped_out_seqs: list[Sequence] = []   # their KV moves in this step
        self.constrained = False     # a row's seq follows a grammar (its bitmask ships)

    @property
    def is_empty(self) -> bool:
        return not (self.decode_rows or self.other_rows or self.swap_out or self.swap_in
                    or self.copy)

    def add(self, seq: Sequence, num_tokens: int, copies: list[list[int]]) -> None:
        """Put `seq` into the step with `num_tokens` tokens; its slots are allocated and
        `copies` are the copy-on-write pairs that allocation returned.

        Blocks this step fills are registered in the prefix cache now, so that a prompt
        admitted later in the same step maps them instead of computing them again (see
        BlockManager.cache_computed_blocks).
        """
        c = seq.num_computed_tokens
        bs = self.block_size
        if copies:
            self.copy.extend(copies)
            # The copy replaced table entry c // block_size: theirs is stale from there.
            if seq.num_blocks_synced > c // bs:
                seq.num_blocks_synced = c // bs
        seq.num_scheduled_tokens = num_tokens
        self.budget -= num_tokens
        end = c + num_tokens
        if end // bs > seq.num_cached_blocks:
            self.block_manager.cache_computed_blocks(seq, end)
        if seq.matcher is not None:
            self.constrained = True
        tokens = seq.token_ids
        table = seq.block_table
        sent = seq.num_tokens_sent
        n = len(tokens)
        num_blocks = len(table)
        if sent < 0:
            g = seq.group
            self.new_seqs.append(NewSeq(seq.seq_id, g.request_id, list(tokens), seq.prompt_len,
                                        list(table), g.sampling, seq.sample_index))
            sent, keep, blocks = n, -1, _NO_BLOCKS
        else:
            synced = seq.num_blocks_synced
            keep = -1 if synced == seq.num_blocks_sent else synced
            blocks = table[synced:] if synced < num_blocks else _NO_BLOCKS
        seq.num_tokens_sent = n
        seq.num_blocks_sent = seq.num_blocks_synced = num_blocks
        num_append = n - sent
        if end == n and num_tokens == 1:
            if num_append == 1:                     # a steady decode: no slice to build
                self.decode_tokens.append(tokens[sent])
            elif num_append:
                self.decode_tokens += tokens[sent:]
            self.decode_rows.append((seq, seq.seq_id, c, num_append, keep, blocks))
        else:
            self.other_rows.append((end == n, seq, seq.seq_id, c, num_tokens, num_append, keep,
                                    blocks, tokens[sent:] if num_append else _NO_TOKENS))

    def add_swap_out(self, seqs: list[Sequence], pairs: list[list[int]]) -> None:
        self.swap_out.extend(pairs)
        self.swapped_out_seqs.extend(seqs)

    def add_swap_in(self, seqs: list[Sequence], pairs: list[list[int]]) -> None:
        """The seqs' tables now hold fresh GPU blocks: the executors' tables are resent."""
        self.swap_in.extend(pairs)
        for seq in seqs:
            seq.num_blocks_synced = 0

    def build(self, step_id: int) -> tuple[StepPlan, list[Sequence]]:
        """The plan, rows in the executors' order, and the Sequence of each row."""
        if self.decode_rows:
            seqs, seq_ids, computed, appends, keeps, blocks = map(list, zip(*self.decode_rows))
        else:
            seqs, seq_ids, computed, appends, keeps, blocks = [], [], [], [], [], []
        appended = self.decode_tokens
        num_tokens = [1] * len(seqs)
        num_sampling_rows = len(seqs)
        if self.other_rows:
            self.other_rows.sort(key=_samples_last)      # stable: schedule order otherwise
            samples, *columns, tokens = zip(*self.other_rows)
            num_sampling_rows += sum(samples)
            for column, more in zip((seqs, seq_ids, computed, num_tokens, appends, keeps,
                                     blocks), columns):
                column += more
            for more in tokens:
                appended += more
        plan = StepPlan(step_id, self.new_seqs, seq_ids, computed, num_tokens, appends,
                        appended, keeps, blocks, num_sampling_rows, self.swap_out, self.swap_in,
                        self.copy, self.finished_seq_ids)
        if self.constrained:
            add_bitmasks(plan, seqs)
        return plan, seqs


def _samples_last(row: tuple) -> bool:
    return not row[0]
