"""Applying a step's result: sampled tokens, the finish rules, beam steps, the step's news.

    StepResult ──▶ apply_result ──▶ per sampling row: the finish rules ─▶ a row (delta)
                                    per beam group:   beam_step (select, fork, free)
                               ──▶ StepOutputs: a row per single-sequence request that
                                    sampled, whole RequestOutputs for the rest

The result is positional: token r answers row r of the plan (shared/messages.py, StepPlan),
so nothing is looked up by id. The finish rules live in apply_result's row loop only: a stop
token (once min_tokens are out) ends a seq without joining its tokens; reaching max_tokens
or max_model_len ends it "length".
"""
from __future__ import annotations

from itertools import chain, islice, repeat
from typing import TYPE_CHECKING

import numpy as np

from services.scheduler.beam_search import BeamSearch
from services.scheduler.constrained import consume
from services.scheduler.sequence import Sequence, SequenceGroup, SequenceStatus
from shared.messages import RequestOutput, SeqDelta, StepPlan, StepResult, TokenLogprob
from shared.wire import encode, tuple_encoder

if TYPE_CHECKING:
    from services.scheduler.lead import Lead
    from services.scheduler.scheduler import Scheduler

RUNNING = SequenceStatus.RUNNING

# NOTE: most deltas carry no logprobs and most rows no candidates: they share one empty list
# each instead of allocating one per sequence per step. Never append to these.
_NO_LOGPROBS: list[TokenLogprob] = []
_NO_TOP: list[list] = []
_NO_TOKENS: list[int] = []

# One RequestOutput encoded for its output stream, with what its publisher reads of it:
#   (request_id, finished, failed: it carries an error, num_tokens: the tokens it adds over
#    all its sequences, data: the bytes of encode(the RequestOutput))
# A plain tuple: a step makes one per running request.
Outgoing = tuple[str, bool, bool, int, bytes]


class StepOutputs:
    """One step's news, columnar. Most of a step is single-sequence requests that have had
    their first output: each is one row, its group followed by its delta's SeqDelta fields

        rows[i]   (group, index, token, logprobs, finish_reason, stop_token_id,
                   cumulative_logprob)

    where `token` is the one token the step added to the sequence, or None when it added
    none (a stop token ends a sequence without joining it); `seq_delta` makes the row's
    SeqDelta. The rows of the running queue's lead that go on (lead.py) stay columns until
    read: `lead` is (the Lead, their slots, seq ids, tokens, cumulative logprobs).

    and its RequestOutput is built by `request_outputs()`, where the outputs are published,
    not per row in the core's loop. Everything else (a request's first output, parallel
    samples, a beam search's end, a failed step) is a whole RequestOutput in `outputs`.
    """

    __slots__ = ("_rows", "outputs", "lead")

    def __init__(self, rows: list[tuple], outputs: list[RequestOutput],
                 lead: tuple | None = None) -> None:
        self._rows = rows
        self.outputs = outputs
        self.lead = lead

    def __len__(self) -> int:
        """Requests with news (one RequestOutput each)."""
        return len(self._rows) + len(self.outputs) + (len(self.lead[1]) if self.lead else 0)

    @property
    def rows(self) -> list[tuple]:
        """Every row, the lead's first (made from its columns once)."""
        if self.lead is not None:
            self._rows = lead_rows(*self.lead) + self._rows
            self.lead = None
        return self._rows

    def encoded(self) -> list[Outgoing]:
        """The same RequestOutputs as request_outputs(), encoded for their output streams
        (what the scheduler service publishes). A row is packed from its fields without
        building its RequestOutput and SeqDelta (docs/overhead.md, the scheduler's output
        path); tests/scheduler/test_outputs.py holds the bytes equal to
        encode(request_outputs())."""
        pack = tuple_encoder(RequestOutput)
        outs = [(group.request_id, reason is not None, False, 0 if token is None else 1,
                 # RequestOutput's fields, its one SeqDelta's fields nested.
                 pack((group.request_id,
                       [(index, _NO_TOKENS if token is None else [token], logprobs, reason,
                         stop_token_id, cum)],
                       reason is not None, group.prompt_len, group.num_cached_tokens,
                       None, None, 0)))
                for group, index, token, logprobs, reason, stop_token_id, cum in self.rows]
        outs += map(outgoing, self.outputs)
        return outs

    def request_outputs(self) -> list[RequestOutput]:
        """One RequestOutput per request with news (a row's request has finished exactly
        when its delta has a finish reason)."""
        outs = [RequestOutput(row[0].request_id, [seq_delta(row)], row[4] is not None,
                              row[0].prompt_len, row[0].num_cached_tokens)
                for row in self.rows]
        outs += self.outputs
        return outs


def lead_rows(lead: Lead, slots: np.ndarray, seq_ids: np.ndarray, tokens: np.ndarray,
              cums: np.ndarray) -> list[tuple]:
    """The news rows of lead seqs that went on, one token each (read while their slots still
    hold them: a slot is taken again only after every other free one)."""
    seqs, groups = lead.seqs, lead.groups
    rows = []
    for s, seq_id, token, cum in zip(slots.tolist(), seq_ids.tolist(), tokens.tolist(),
                                     cums.tolist()):
        seq = seqs[s]
        if seq.seq_id != seq_id:
            raise RuntimeError("a step's news was read after its lead slots were taken again")
        rows.append((groups[s], seq.sample_index, token, _NO_LOGPROBS, None, None, cum))
    return rows


def outgoing(out: RequestOutput) -> Outgoing:
    return (out.request_id, out.finished, out.error is not None,
            sum(len(s.token_ids) for s in out.seqs), encode(out))


def seq_delta(row: tuple) -> SeqDelta:
    """The SeqDelta of a row of the step's news (see StepOutputs)."""
    _, index, token, logprobs, reason, stop_token_id, cum = row
    return SeqDelta(index, [] if token is None else [token], logprobs, reason, stop_token_id,
                    cum)


def request_output(group: SequenceGroup, deltas: list[SeqDelta]) -> RequestOutput:
    """A request's news; its first one also carries the prompt logprobs (when asked)."""
    out = RequestOutput(group.request_id, deltas, False, group.prompt_len,
                        group.num_cached_tokens)
    if not group.first_output_sent:
        group.first_output_sent = True
        if group.prompt_logprobs is not None:
            out.prompt_logprobs = [None, *group.prompt_logprobs]
    return out


def final_output(group: SequenceGroup, reason: str) -> RequestOutput:
    """The last output of a request ended now with `reason`: every live seq ends with it; a
    beam search reports its n best beams so far, whole (beams stream nothing)."""
    if group.is_beam:
        hyps = group.beam.best(max(1, group.sampling.n), group.seqs)
        deltas = [SeqDelta(i, h.token_ids, h.logprobs or [], reason, h.stop_token_id,
                           h.cumulative_logprob) for i, h in enumerate(hyps)]
    else:
        deltas = [SeqDelta(s.sample_index, [], finish_reason=reason,
                           cumulative_logprob=s.cumulative_logprob) for s in group.seqs]
    out = request_output(group, deltas)
    out.finished = True
    return out


def result_error(plan: StepPlan, result: StepResult) -> str | None:
    """Why `result` cannot be applied to `plan` (None when it can)."""
    if result.error is not None:
        return result.error
    n = plan.num_sampling_rows
    if len(result.token_ids) != n or len(result.logprobs) != n:
        return (f"the executor returned {len(result.token_ids)} tokens for the "
                f"{n} sampling rows of step {plan.step_id}")
    if result.top and len(result.top) != n:
        return f"the executor returned {len(result.top)} candidate lists for {n} sampling rows"
    if result.prompt_logprobs and len(result.prompt_logprobs) != len(plan.seq_ids):
        return (f"the executor returned prompt logprobs for {len(result.prompt_logprobs)} "
                f"of {len(plan.seq_ids)} rows")
    return None


def fail_step(core: Scheduler, seqs: list[Sequence], error: str) -> StepOutputs:
    """End every request of `seqs` (what a failed step ran or swapped out: their KV state is
    unknown) with the error; the executors drop their seqs with the next plan."""
    failed = []
    for group in {s.group.request_id: s.group for s in seqs}.values():
        if group.status != SequenceStatus.FINISHED:
            out = core.abort_request(group.request_id, "error")
            out.error = f"the model step failed: {error}"
            out.error_code = 500
            failed.append(out)
    return StepOutputs([], failed)


def apply_result(core: Scheduler, plan: StepPlan, seqs: list[Sequence], result: StepResult,
                 lead: tuple | None = None) -> StepOutputs:
    """Advance every row's seq by its scheduled tokens and apply the sampled ones. Returns
    the news of every request that has some. The plan's first rows are the lead's when
    `lead` holds their (slots, seq ids); `seqs[i]` is the seq of the next row i. A seq that
    finished or was aborted while the step ran is skipped."""
    k = 0 if lead is None else len(lead[0])
    if result.prompt_logprobs:
        _add_prompt_logprobs(seqs, result.prompt_logprobs[k:])
    num_sampling = plan.num_sampling_rows
    rows: list[tuple] = []
    outs: list[RequestOutput] = []
    grouped: dict[str, RequestOutput] = {}   # request id -> its whole output
    beam_steps: dict[str, list] = {}
    prompt_done = 0
    num_skipped = 0
    any_finished = False
    news = None
    tops = islice(result.top, k, None) if result.top else repeat(_NO_TOP)
    per_seq = zip(seqs, islice(result.token_ids, k, None), islice(result.logprobs, k, None),
                  tops)
    if k:
        news, left = _apply_lead(core, lead, result, rows)
        if left:
            per_seq = chain([(seq, t, lp, _NO_TOP) for seq, t, lp in left], per_seq)
    for seq, token, logprob, top in per_seq:
        if seq.status is not RUNNING:      # aborted or finished while in flight
            num_skipped += 1
            continue
        c = seq.num_computed_tokens
        if c < seq.prompt_len:
            prompt_done += seq.prompt_len - c  # a sampling row computes up to the seq's end
        seq.num_computed_tokens = c + seq.num_scheduled_tokens
        seq.num_scheduled_tokens = 0
        group = seq.group
        if group.is_beam:
            beam_steps.setdefault(group.request_id, []).append((seq, top))
            continue
        # The finish rules: a stop token (once min_tokens are out) ends the seq without
        # joining its tokens; reaching max_tokens or max_model_len ends it "length".
        tokens = seq.token_ids
        cum = seq.cumulative_logprob = seq.cumulative_logprob + logprob
        if token in group.stop_ids and len(tokens) >= group.min_len:
            seq.finish_reason = reason = "stop"
            seq.stop_token_id = token
            # The stop token's own logprob rides along when logprobs are asked (clients
            # such as lm-eval score it, and vLLM reports it); the token stays out of
            # token_ids.
            lps = (_NO_LOGPROBS if seq.logprobs is None else
                   [TokenLogprob(token, logprob, top[:group.sampling.logprobs])])
            row = (group, seq.sample_index, None, lps, reason, token, cum)
        else:
            tokens.append(token)
            reason = None if seq.matcher is None else consume(seq, token)
            if reason is None and len(tokens) >= group.max_len:
                reason = "length"
            if reason is not None:
                seq.finish_reason = reason
            if seq.logprobs is None:
                lps = _NO_LOGPROBS
            else:
                lp = TokenLogprob(token, logprob, top[:group.sampling.logprobs])
                seq.logprobs.append(lp)
                lps = [lp]
            row = (group, seq.sample_index, token, lps, reason, None, cum)
        if group.max_num_seqs == 1 and group.first_output_sent:
            rows.append(row)
            out = None
        else:
            out = grouped.get(group.request_id)
            if out is None:
                out = grouped[group.request_id] = request_output(group, [])
                outs.append(out)
            out.seqs.append(seq_delta(row))
        if reason is not None:
            core.release_seq(seq)
            group.seqs.remove(seq)
            if not group.seqs:
                if out is not None:
                    out.finished = True
                core.finish_group(group, prune_running=False)
                any_finished = True
    for seq in seqs[num_sampling - k:]:      # prefill chunks short of their seq's end
        if seq.status == RUNNING:
            c = seq.num_computed_tokens
            t = seq.num_scheduled_tokens
            prompt_done += min(c + t, seq.prompt_len) - c
            seq.num_computed_tokens = c + t
            seq.num_scheduled_tokens = 0
    for rid, beams in beam_steps.items():
        out = beam_step(core, core.groups[rid], beams)
        if out is not None:
            outs.append(out)
            any_finished = True
    core.prompt_tokens_total += prompt_done
    core.generation_tokens_total += num_sampling - num_skipped
    if any_finished:                         # (the lead's are out already)
        running = core.running
        m = len(core.lead)
        running[m:] = [g for g in running[m:] if g.status == RUNNING]
    return StepOutputs(rows, outs, news)


def _apply_lead(core: Scheduler, lead_rows: tuple, result: StepResult, rows: list[tuple]
                ) -> tuple[tuple, list[tuple]]:
    """The lead's rows of a result (Lead.apply); the seqs that end get their row in `rows`
    and leave. Returns (the columns of the rest's news, the rows of seqs that left the lead
    while the step ran, for the per-seq path)."""
    lead = core.lead
    slots, tokens, cums, stop, long, left = lead.apply(*lead_rows, result.token_ids,
                                                       result.logprobs)
    seq_ids = lead.seq_id[slots]
    ended = stop | long
    if ended.any():
        gone = slots[ended].tolist()
        for s, token, cum, stopped in zip(gone, tokens[ended].tolist(), cums[ended].tolist(),
                                          stop[ended].tolist()):
            seq = lead.seqs[s]
            seq.finish_reason = reason = "stop" if stopped else "length"
            if stopped:
                seq.stop_token_id = token
            rows.append((lead.groups[s], seq.sample_index, None if stopped else token,
                         _NO_LOGPROBS, reason, token if stopped else None, cum))
        lead.remove(core.running, gone)
        for s in gone:
            group = lead.groups[s]
            core.release_seq(lead.seqs[s])
            group.seqs = []
            core.finish_group(group, prune_running=False)
        on = ~ended
        slots, seq_ids, tokens, cums = slots[on], seq_ids[on], tokens[on], cums[on]
    return (lead, slots, seq_ids, tokens, cums), left


def _add_prompt_logprobs(seqs: list[Sequence], per_row: list[list[TokenLogprob]]) -> None:
    """Keep the prompt logprobs a step computed, on the group of the leader that computed
    them (until the first output carries them)."""
    for seq, lps in zip(seqs, per_row):
        group = seq.group
        if (lps and seq.status == RUNNING and group.prompt_logprobs is not None
                and seq is group.seqs[0]):
            room = group.prompt_len - 1 - len(group.prompt_logprobs)
            if room > 0:
                group.prompt_logprobs.extend(lps[:room])


def beam_step(core: Scheduler, group: SequenceGroup, beams: list) -> RequestOutput | None:
    """Select the next beams; fork, extend and free seqs. Returns the final output when the
    search is over, else None (beam requests report only when finished)."""
    search: BeamSearch = group.beam
    chosen, done = search.step(beams)
    if done:
        hyps = search.best(max(1, group.sampling.n))
        deltas = [SeqDelta(i, h.token_ids, h.logprobs or [], h.finish_reason,
                           h.stop_token_id, h.cumulative_logprob)
                  for i, h in enumerate(hyps)]
        out = request_output(group, deltas)
        out.finished = True
        core.finish_group(group, prune_running=False)
        return out
    by_parent: dict[int, list] = {}
    for cand in chosen:
        by_parent.setdefault(cand.parent.seq_id, []).append(cand)
    kept = []
    for seq in group.seqs:
        if seq.seq_id not in by_parent:
            core.release_seq(seq)            # a beam no candidate extends
        else:
            kept.append(seq)
    children = []
    for seq in kept:
        cands = by_parent[seq.seq_id]
        for cand in cands[1:]:
            child = group.new_seq(next(core.seq_ids), seq.token_ids + [cand.token_id],
                                  seq.prompt_len)
            core.block_manager.fork(seq, child)
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
