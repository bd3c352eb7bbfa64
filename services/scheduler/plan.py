"""The plan builder: what the executors hold of each sequence, and the StepPlan under way.

The executors keep every sequence they were sent (its tokens and block table) until a plan
drops it, so a plan carries only what changed. Each `Sequence` mirrors their copy:

    num_tokens_sent     tokens they hold (-1: they do not know the seq; send it whole)
    num_blocks_sent     length of their block table
    num_blocks_synced   leading entries of their table equal to ours (a copy-on-write or a
                        swap-in replaces entries: from there on, theirs are stale)

`add` (any sequence) and `add_decodes` (sequences with one token to compute, the bulk of a
step) are the ways a sequence enters a step, whatever path scheduled it: they register the
blocks the step fills in the prefix cache, write the sequence's row (its diffs against the
mirror) and move the mirror forward; `add` hands a decode to `add_decodes`. Rows go in the
order the executors run them (shared/messages.py, StepPlan): decodes that sample (steady
ones first), then other rows that sample, then prefill chunks that stop short of their
sequence's end.
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

    __slots__ = ("block_manager", "block_size", "budget", "lead", "steady_seqs", "steady_ids",
                 "steady_computed", "steady_tokens", "steady_blocks", "decode_rows", "decode_tokens",
                 "other_rows", "new_seqs", "swap_out", "swap_in", "copy", "finished_seq_ids",
                 "swapped_out_seqs", "constrained")

    def __init__(self, block_manager: BlockManager, budget: int, finished_seq_ids: list[int],
                 constrained: bool = False) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.budget = budget
        # Steady decodes (the bulk of a step) go straight into three columns; the columns
        # they share with no other row (one token, one appended, table unchanged) are made
        # whole by build(). Other rows are tuples, turned into columns by build() (one
        # C-level transpose instead of one list append per column per row):
        #   decode_rows  (seq, seq_id, computed, num_append, keep, blocks): one token, sampled;
        #                their appended tokens go to decode_tokens after the steady ones'
        #   other_rows   (samples, seq, seq_id, computed, tokens, num_append, keep, blocks,
        #                 appended tokens)
        # The running queue's lead, scheduled first on columns (lead.py): its slots and seq
        # ids (numpy), and its rows' computed, tokens and new blocks.
        self.lead: tuple | None = None
        self.steady_seqs: list[Sequence] = []
        self.steady_ids: list[int] = []
        self.steady_computed: list[int] = []
        self.steady_tokens: list[int] = []
        self.steady_blocks: list[list[int]] = []
        self.decode_rows: list[tuple] = []
        self.decode_tokens: list[int] = []
        self.other_rows: list[tuple] = []
        self.new_seqs: list[NewSeq] = []
        self.swap_out: list[list[int]] = []
        self.swap_in: list[list[int]] = []
        self.copy: list[list[int]] = []
        self.finished_seq_ids = finished_seq_ids
        self.swapped_out_seqs: list[Sequence] = []   # their KV moves in this step
        # A request that follows a grammar is running: the rows' bitmasks are looked for.
        self.constrained = constrained

    @property
    def is_empty(self) -> bool:
        return not (self.lead or self.steady_seqs or self.decode_rows or self.other_rows or self.swap_out
                    or self.swap_in or self.copy)

    def add(self, seq: Sequence, num_tokens: int, copies: list[list[int]]) -> None:
        """Put `seq` into the step with `num_tokens` tokens; its slots are allocated and
        `copies` are the copy-on-write pairs that allocation returned.

        Blocks this step fills are registered in the prefix cache now, so that a prompt
        admitted later in the same step maps them instead of computing them again (see
        BlockManager.cache_computed_blocks).
        """
        c = seq.num_computed_tokens
        if copies:
            self.copy.extend(copies)
            # The copy replaced table entry c // block_size: theirs is stale from there.
            if seq.num_blocks_synced > c // self.block_size:
                seq.num_blocks_synced = c // self.block_size
        tokens = seq.token_ids
        end = c + num_tokens
        if end // self.block_size > seq.num_cached_blocks:
            self.block_manager.cache_computed_blocks(seq, end)
        if num_tokens == 1 and end == len(tokens):
            self.add_decodes([seq])
            return
        seq.num_scheduled_tokens = num_tokens
        self.budget -= num_tokens
        sent, keep, blocks = self._sync(seq)
        self.other_rows.append((end == len(tokens), seq, seq.seq_id, c, num_tokens,
                                len(tokens) - sent, keep, blocks,
                                tokens[sent:] if sent < len(tokens) else _NO_TOKENS))

    def add_lead(self, slots, seq_ids, computed: list[int], tokens: list[int],
                 blocks: list[list[int]]) -> None:
        """The lead's decodes (lead.py): the plan's first rows, their mirror moved already."""
        self.lead = (slots, seq_ids, computed, tokens, blocks)
        self.budget -= len(computed)

    def add_decodes(self, seqs: list[Sequence]) -> None:
        """add(seq, 1, no copies) for each seq: one token, its last, whose slot is allocated
        and whose full blocks are in the prefix cache (BlockManager.decode_slots, or add).
        The bulk of every step: a steady decode (the executors hold every token but the one
        sampled last, and the same block table or one block less) is written without the
        general diff, in queue order (as the lead writes it, lead.py)."""
        steady_seqs = self.steady_seqs
        steady_ids = self.steady_ids
        steady_computed = self.steady_computed
        steady_tokens = self.steady_tokens
        steady_blocks = self.steady_blocks
        for seq in seqs:
            c = seq.num_computed_tokens
            end = c + 1
            seq.num_scheduled_tokens = 1
            sent = seq.num_tokens_sent
            synced = seq.num_blocks_synced
            table = seq.block_table
            if sent == c and synced == seq.num_blocks_sent and 0 <= len(table) - synced <= 1:
                seq.num_tokens_sent = end
                steady_seqs.append(seq)
                steady_ids.append(seq.seq_id)
                steady_computed.append(c)
                steady_tokens.append(seq.token_ids[c])
                if len(table) == synced:
                    steady_blocks.append(_NO_BLOCKS)
                else:
                    steady_blocks.append(table[synced:])
                    seq.num_blocks_sent = seq.num_blocks_synced = len(table)
            else:
                sent, keep, blocks = self._sync(seq)
                self.decode_tokens += seq.token_ids[sent:]
                self.decode_rows.append((seq, seq.seq_id, c, end - sent, keep, blocks))
        self.budget -= len(seqs)

    def _sync(self, seq: Sequence) -> tuple[int, int, list[int]]:
        """Move the mirror of `seq` to its tokens and table. Returns (tokens the executors
        held, the row's keep, the row's blocks); a seq they do not know goes whole into
        new_seqs, with nothing to append."""
        tokens = seq.token_ids
        table = seq.block_table
        sent = seq.num_tokens_sent
        if sent < 0:
            g = seq.group
            self.new_seqs.append(NewSeq(seq.seq_id, g.request_id, list(tokens), seq.prompt_len,
                                        list(table), g.sampling, seq.sample_index))
            sent, keep, blocks = len(tokens), -1, _NO_BLOCKS
        else:
            synced = seq.num_blocks_synced
            keep = -1 if synced == seq.num_blocks_sent else synced
            blocks = table[synced:] if synced < len(table) else _NO_BLOCKS
        seq.num_tokens_sent = len(tokens)
        seq.num_blocks_sent = seq.num_blocks_synced = len(table)
        return sent, keep, blocks

    def add_swap_out(self, seqs: list[Sequence], pairs: list[list[int]]) -> None:
        self.swap_out.extend(pairs)
        self.swapped_out_seqs.extend(seqs)

    def add_swap_in(self, seqs: list[Sequence], pairs: list[list[int]]) -> None:
        """The seqs' tables now hold fresh GPU blocks: the executors' tables are resent."""
        self.swap_in.extend(pairs)
        for seq in seqs:
            seq.num_blocks_synced = 0

    def build(self, step_id: int) -> tuple[StepPlan, list[Sequence]]:
        """The plan, rows in the executors' order, and the Sequence of each row after the
        lead's (the lead's rows come first; `lead` holds their slots)."""
        seqs = self.steady_seqs
        if self.lead is None:
            seq_ids = self.steady_ids
            computed = self.steady_computed
            appended = self.steady_tokens
            blocks = self.steady_blocks
        else:
            _, ids, computed, appended, blocks = self.lead
            seq_ids = ids.tolist()
            seq_ids += self.steady_ids
            computed += self.steady_computed
            appended += self.steady_tokens
            blocks += self.steady_blocks
        k = len(seq_ids)
        appends = [1] * k
        keeps = [-1] * k
        if self.decode_rows:
            columns = zip(*self.decode_rows)
            for column, more in zip((seqs, seq_ids, computed, appends, keeps, blocks), columns):
                column += more
            appended += self.decode_tokens
        num_tokens = [1] * len(seq_ids)
        num_sampling_rows = len(seq_ids)
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
            add_bitmasks(plan, seqs, len(seq_ids) - len(seqs))
        return plan, seqs


def _samples_last(row: tuple) -> bool:
    return not row[0]
