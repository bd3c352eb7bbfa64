"""Where a grammar meets the step: the three hooks of a constrained request's life.

    admission   grammar.admit_constrained   each sequence gets its own matcher once its
                                  grammar is compiled (off the step's path, cached by spec;
                                  n samples follow it independently)
    plan        add_bitmasks      each constrained row that samples ships the bitmask of the
                                  tokens its matcher allows next (StepPlan.token_bitmask)
    result      consume           the sampled token advances the matcher; it says whether
                                  the sequence ends there ("stop": the grammar is complete;
                                  "error": a token it refused)
"""
from __future__ import annotations

from services.scheduler.grammar import fill_masks
from services.scheduler.sequence import Sequence
from shared.messages import StepPlan


def add_bitmasks(plan: StepPlan, seqs: list[Sequence], first: int = 0) -> None:
    """The allowed-token bitmask of every constrained row that samples this step (its
    matcher has seen every output token so far: masks are computed when the plan is built,
    and the sampled tokens advance the matchers in `consume`). `seqs[i]` is the seq of row
    first + i (the rows before are the lead's, never constrained)."""
    rows = [r for r in range(first, plan.num_sampling_rows) if seqs[r - first].matcher is not None]
    if not rows:
        return
    plan.token_bitmask = fill_masks([seqs[r - first] for r in rows])
    plan.bitmask_rows = rows
    plan.bitmask_words = len(plan.token_bitmask) // (4 * len(rows))


def consume(seq: Sequence, token: int) -> str | None:
    """Advance `seq`'s matcher by its sampled token; the finish reason it implies, if any.

    The mask allowed only tokens the grammar accepts; once it is complete (nothing but EOS
    may follow) the seq ends "stop" without a step to sample the EOS."""
    matcher = seq.matcher
    if not matcher.consume_token(token):
        return "error"
    if matcher.is_stopped():
        return "stop"
    return None
