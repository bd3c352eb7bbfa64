"""Where a grammar meets the step: the three hooks of a constrained request's life.

    admission   attach_matchers   each sequence gets its own matcher (grammar.py compiles and
                                  caches the grammar; n samples follow it independently)
    plan        add_bitmasks      each constrained row that samples ships the bitmask of the
                                  tokens its matcher allows next (StepPlan.token_bitmask)
    result      consume           the sampled token advances the matcher; it says whether
                                  the sequence ends there ("stop": the grammar is complete;
                                  "error": a token it refused)
"""
from __future__ import annotations

from services.scheduler.admission import AdmissionError
from services.scheduler.grammar import GrammarError, Grammars, allowed_mask
from services.scheduler.sequence import Sequence, SequenceGroup
from shared.messages import StepPlan


def attach_matchers(grammars: Grammars, group: SequenceGroup) -> None:
    """Give every seq of a constrained request its matcher. Raises AdmissionError for a
    grammar that does not compile, or a constraint on a beam search."""
    sp = group.sampling
    if sp.constraint is None:
        return
    if sp.beam_width > 0:
        raise AdmissionError("beam search cannot follow an output constraint "
                             "(response_format, structured_outputs, tools): drop one")
    try:
        matcher = grammars.matcher(sp.constraint)
    except GrammarError as exc:
        raise AdmissionError(str(exc)) from None
    for i, seq in enumerate(group.seqs):
        seq.matcher = matcher if i == 0 else matcher.deep_copy()


def add_bitmasks(plan: StepPlan, seqs: list[Sequence]) -> None:
    """The allowed-token bitmask of every constrained row that samples this step (its
    matcher has seen every output token so far: masks are computed when the plan is built,
    and the sampled tokens advance the matchers in `consume`)."""
    rows = [r for r in range(plan.num_sampling_rows) if seqs[r].matcher is not None]
    if not rows:
        return
    masks = [allowed_mask(seqs[r].matcher, seqs[r].group.stop_ids) for r in rows]
    plan.bitmask_rows = rows
    plan.bitmask_words = len(masks[0]) // 4
    plan.token_bitmask = b"".join(masks)


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
