"""A tiny plan builder that drives ModelRunner the way the scheduler will, for the tests.

It owns a free list of GPU and CPU blocks and builds StepPlans under a token budget:
decodes first (1 token each), then prefill chunks of whatever budget is left, so prompts
are split into chunks and decodes mix with prefill chunks in one flat batch. It can force
the two preemption paths mid-generation: swap out / swap in (the seq comes back on new
GPU block ids) and recompute (drop the seq, re-send it later as a NewSeq with all tokens).
No policy beyond that: this is a test driver, not the scheduler.
"""
from __future__ import annotations

from collections import deque, namedtuple
from dataclasses import dataclass, field

from shared.messages import NewSeq, SamplingParams, StepPlan, StepResult


# One row of a plan, as the tests write it (the plan itself is columnar).
Row = namedtuple("Row", "seq_id num_computed_tokens num_tokens append_token_ids block_keep "
                        "block_append", defaults=([], -1, []))


def step_plan(step_id: int, new_seqs: list[NewSeq] = (), rows: list[Row] = (),
              sampling: int | None = None, **cache_ops) -> StepPlan:
    """A StepPlan of these rows; the first `sampling` of them (default: all) sample."""
    plan = StepPlan(step_id, list(new_seqs), **cache_ops)
    for row in rows:
        row = Row(*row)
        for column, value in zip((plan.seq_ids, plan.num_computed_tokens, plan.num_tokens,
                                  plan.num_append_tokens, plan.block_keep, plan.block_append),
                                 row._replace(append_token_ids=len(row.append_token_ids))):
            column.append(value)
        plan.append_token_ids += row.append_token_ids
    plan.num_sampling_rows = len(rows) if sampling is None else sampling
    return plan


@dataclass
class TestSeq:
    seq_id: int
    tokens: list[int]
    prompt_len: int
    sampling: SamplingParams
    max_new: int
    sample_index: int = 0
    table: list[int] = field(default_factory=list)
    num_computed: int = 0
    state: str = "new"          # new | running | swapped | dropped | done
    cpu_table: list[int] = field(default_factory=list)
    to_append: list[int] = field(default_factory=list)   # sampled since the last plan
    block_keep: int = -1
    block_append: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)

    @property
    def prompt(self) -> list[int]:
        return self.tokens[:self.prompt_len]


class PlanBuilder:
    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 token_budget: int) -> None:
        # Freed blocks go to the back, allocation takes from the front: a seq that is
        # swapped back in gets different block ids than it had.
        self.free_gpu = deque(range(num_gpu_blocks))
        self.free_cpu = deque(range(num_cpu_blocks))
        self.block_size = block_size
        self.budget = token_budget
        self.seqs: dict[int, TestSeq] = {}
        self.step_id = 0
        self._swap_out: list[list[int]] = []
        self._swap_in: list[list[int]] = []
        self._finished: list[int] = []
        self._last_plan: StepPlan | None = None

    def add(self, seq_id: int, prompt: list[int], sampling: SamplingParams, max_new: int,
            sample_index: int = 0) -> TestSeq:
        seq = TestSeq(seq_id, list(prompt), len(prompt), sampling, max_new, sample_index)
        self.seqs[seq_id] = seq
        return seq

    @property
    def done(self) -> bool:
        return all(s.state == "done" for s in self.seqs.values())

    # ------------------------------------------------------------------ preemption

    def swap_out(self, seq_id: int) -> None:
        seq = self.seqs[seq_id]
        assert seq.state == "running"
        seq.cpu_table = [self.free_cpu.popleft() for _ in seq.table]
        self._swap_out += [[g, c] for g, c in zip(seq.table, seq.cpu_table)]
        self.free_gpu.extend(seq.table)
        seq.table, seq.state = [], "swapped"

    def swap_in(self, seq_id: int) -> list[int]:
        """Bring a swapped seq back; returns its new GPU block table."""
        seq = self.seqs[seq_id]
        assert seq.state == "swapped"
        seq.table = [self.free_gpu.popleft() for _ in seq.cpu_table]
        self._swap_in += [[c, g] for c, g in zip(seq.cpu_table, seq.table)]
        self.free_cpu.extend(seq.cpu_table)
        seq.block_keep, seq.block_append = 0, list(seq.table)
        seq.cpu_table, seq.state = [], "running"
        return seq.table

    def recompute(self, seq_id: int) -> None:
        """Preempt by recompute: the executor drops the seq now; it returns as a NewSeq
        carrying prompt + outputs in a later plan."""
        seq = self.seqs[seq_id]
        assert seq.state == "running"
        self.free_gpu.extend(seq.table)
        seq.table, seq.num_computed, seq.to_append = [], 0, []
        seq.block_keep, seq.block_append = -1, []
        seq.state = "dropped"
        self._finished.append(seq_id)

    # ------------------------------------------------------------------ one step

    def next_plan(self) -> StepPlan:
        plan = StepPlan(self.step_id, swap_out=self._swap_out, swap_in=self._swap_in,
                        finished_seq_ids=self._finished)
        self.step_id += 1
        self._swap_out, self._swap_in, self._finished = [], [], []
        left = self.budget
        running = [s for s in self.seqs.values() if s.state in ("running", "new")]
        decodes = [s for s in running if len(s.tokens) - s.num_computed == 1]
        prefills = [s for s in running if len(s.tokens) - s.num_computed > 1]
        rows = []
        for seq in decodes + prefills:
            n = min(len(seq.tokens) - seq.num_computed, left)
            if n <= 0:
                break
            left -= n
            grow = [self.free_gpu.popleft()
                    for _ in range(-(-(seq.num_computed + n) // self.block_size) - len(seq.table))]
            seq.table += grow
            if seq.state == "new":
                plan.new_seqs.append(NewSeq(seq.seq_id, f"req-{seq.seq_id}", list(seq.tokens),
                                            seq.prompt_len, list(seq.table), seq.sampling,
                                            seq.sample_index))
                seq.state = "running"
                row = (seq.seq_id, seq.num_computed, n, [], -1, [])
            else:
                row = (seq.seq_id, seq.num_computed, n, seq.to_append, seq.block_keep,
                       seq.block_append + grow)
            rows.append((seq.num_computed + n == len(seq.tokens), row))
            seq.to_append, seq.block_keep, seq.block_append = [], -1, []
            seq.num_computed += n
        rows.sort(key=lambda r: not r[0])     # the rows that sample first, as the contract says
        plan = step_plan(plan.step_id, plan.new_seqs, [row for _, row in rows],
                         sum(samples for samples, _ in rows), swap_out=plan.swap_out,
                         swap_in=plan.swap_in, finished_seq_ids=plan.finished_seq_ids)
        self._last_plan = plan
        for seq in self.seqs.values():
            if seq.state == "dropped" and seq.seq_id in plan.finished_seq_ids:
                seq.state = "new"   # this plan drops it; the next one re-admits it
        return plan

    def apply(self, result: StepResult) -> None:
        assert result.error is None, result.error
        plan = self._last_plan
        assert result.step_id == plan.step_id
        for seq_id, token in zip(plan.seq_ids, result.token_ids):   # row r's token
            seq = self.seqs[seq_id]
            seq.tokens.append(token)
            seq.outputs.append(token)
            seq.to_append.append(token)
            if len(seq.outputs) >= seq.max_new:
                seq.state = "done"
                self.free_gpu.extend(seq.table)
                seq.table = []
                self._finished.append(seq.seq_id)
