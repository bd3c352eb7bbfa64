"""Sequences and sequence groups: a request's token streams and what the executors know of them.

A request (`SequenceGroup`) owns 1..n sequences: one for plain sampling, n for parallel
sampling, up to beam_width live beams for beam search. Each `Sequence` holds its tokens
(prompt + outputs), its block table (GPU block ids while running, CPU block ids while swapped)
and a mirror of the executors' copy of it, so that plans can carry diffs:

    token_ids      [p0 p1 ... p_{L-1} o0 o1 ... o_k]      prompt_len = L
    computed       |<-- num_computed_tokens -->|          KV in the cache
    sent           |<-- num_tokens_sent --------------->| what the executors hold (-1: unknown)
"""
from __future__ import annotations

from enum import IntEnum
from operator import attrgetter

from shared.messages import GenerationRequest, SamplingParams, TokenLogprob


# NOTE: requests nearly all carry the same stop ids (the model's EOS): one shared set stays
# in the cache, where one set per request is a cache miss per sampled token.
_STOP_SETS: dict[frozenset[int], frozenset[int]] = {}


def _shared_stop_ids(stop_token_ids: list[int]) -> frozenset[int]:
    stops = frozenset(stop_token_ids)
    shared = _STOP_SETS.get(stops)
    if shared is None and len(_STOP_SETS) < 1024:
        shared = _STOP_SETS[stops] = stops
    return stops if shared is None else shared


def _hot(column: str, own: str) -> property:
    """A Sequence field kept in the lead's `column` while the seq is in the lead (lead.py),
    else in its own slot `own`."""
    get_own = attrgetter(own)

    def get(seq: Sequence):
        lead = seq.lead
        return get_own(seq) if lead is None else getattr(lead, column)[seq.slot].item()

    def put(seq: Sequence, value) -> None:
        lead = seq.lead
        if lead is None:
            setattr(seq, own, value)
        else:
            getattr(lead, column)[seq.slot] = value
    return property(get, put)


class SequenceStatus(IntEnum):
    WAITING = 0      # not admitted yet, or preempted by recompute
    RUNNING = 1
    SWAPPED = 2      # blocks live in the CPU pool
    FINISHED = 3


class Sequence:
    # NOTE: the fields every step reads and writes come first, so that they share the
    # object's first cache lines (at 1,024 running seqs the seqs no longer fit a core's L2).
    # The fields a steady decode changes every step are properties (below): while the seq is
    # in the running queue's lead (lead.py) they live in its columns, else in the _ slots.
    __slots__ = ("_tokens", "_computed", "_scheduled", "block_table", "_sent",
                 "num_blocks_sent", "num_blocks_synced", "lead", "slot",
                 "num_cached_blocks", "seq_id", "status", "group", "matcher",
                 "_cum", "logprobs", "sample_index", "prompt_len",
                 "block_hashes", "cache_chain_broken", "finish_reason", "stop_token_id")

    def __init__(self, seq_id: int, group: SequenceGroup | None, token_ids: list[int],
                 prompt_len: int, sample_index: int = 0) -> None:
        self.seq_id = seq_id
        self.group = group
        self.lead = None       # the Lead whose columns hold the hot fields, or None
        self.slot = -1         # the seq's row in them
        self._tokens = token_ids
        self.prompt_len = prompt_len
        self.sample_index = sample_index
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self._computed = 0                 # num_computed_tokens
        self._scheduled = 0                # num_scheduled_tokens: this step's chunk (or 0)
        # Prefix cache: chained hash of each full block of token_ids (extended lazily), and how
        # many leading blocks of the table are known to be registered in the cache.
        self.block_hashes: list[int] = []
        self.num_cached_blocks = 0
        self.cache_chain_broken = False     # a block could not be registered: stop trying
        self._cum = 0.0                    # cumulative_logprob
        self.logprobs: list[TokenLogprob] | None = None
        self.finish_reason: str | None = None
        self.stop_token_id: int | None = None
        # llguidance matcher of a constrained request (services/scheduler/grammar.py): the
        # grammar state after this seq's output tokens; None when unconstrained.
        self.matcher = None
        # Mirror of the executors' state, kept by the plan builder (services/scheduler/plan.py):
        self._sent = -1                    # num_tokens_sent; -1: the executors do not know it
        self.num_blocks_sent = 0           # length of their block table
        self.num_blocks_synced = 0         # leading entries of theirs equal to ours

    def forget_blocks(self) -> None:
        """The KV cache lost this seq's blocks (a fresh pool): it holds none, has computed
        nothing, and the executors do not know it."""
        self.block_table = []
        self.num_computed_tokens = self.num_scheduled_tokens = 0
        self.block_hashes = []
        self.num_cached_blocks = 0
        self.cache_chain_broken = False
        self.num_tokens_sent = -1
        self.num_blocks_sent = self.num_blocks_synced = 0
        self.status = SequenceStatus.WAITING

    @property
    def token_ids(self) -> list[int]:
        """Prompt + output tokens (a lead seq's tokens of the last steps are joined first)."""
        lead = self.lead
        if lead is not None and lead.npend[self.slot]:
            lead.flush(self.slot)
        return self._tokens

    @token_ids.setter
    def token_ids(self, tokens: list[int]) -> None:
        if self.lead is not None:
            raise RuntimeError(f"seq {self.seq_id}: its tokens are replaced while in the lead")
        self._tokens = tokens

    @property
    def num_tokens_sent(self) -> int:
        """Tokens the executors hold (-1: none). A lead seq's are its computed ones plus
        the one its step in flight appends (lead.py keeps no column for it)."""
        lead = self.lead
        if lead is None:
            return self._sent
        return int(lead.computed[self.slot] + lead.scheduled[self.slot])

    @num_tokens_sent.setter
    def num_tokens_sent(self, n: int) -> None:
        if self.lead is not None:
            raise RuntimeError(f"seq {self.seq_id}: its mirror is moved while in the lead")
        self._sent = n

    num_computed_tokens = _hot("computed", "_computed")
    num_scheduled_tokens = _hot("scheduled", "_scheduled")
    cumulative_logprob = _hot("cum", "_cum")

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.status.name}, len={len(self.token_ids)}, "
                f"computed={self.num_computed_tokens}, table={self.block_table})")


class SequenceGroup:
    """One request: its live sequences, its place in the queues and its output bookkeeping."""

    # NOTE: the fields every step reads first, as in Sequence.
    __slots__ = ("seqs", "is_beam", "max_num_seqs", "first_output_sent", "stop_ids",
                 "min_len", "max_len", "request_id", "prompt_len", "num_cached_tokens",
                 "status", "forked", "sampling", "request", "arrival_time", "priority",
                 "sort_key", "entry_id", "scheduled_at", "first_token_at", "last_token_at",
                 "beam", "prompt_logprobs", "next_sample_index", "num_preemptions")

    def __init__(self, request: GenerationRequest, sort_key: tuple) -> None:
        sp: SamplingParams = request.sampling
        self.request = request
        self.request_id = request.request_id
        self.sampling = sp
        self.arrival_time = request.arrival_time
        self.priority = request.priority
        self.sort_key = sort_key               # queue order: smaller runs first
        self.prompt_len = len(request.prompt_token_ids)
        # The service's bookkeeping (the core never reads these): the request's entry in the
        # Redis request stream (acknowledged when it ends) and its timeline, unix seconds.
        self.entry_id = ""
        self.scheduled_at = 0.0
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.seqs: list[Sequence] = []         # live sequences; seqs[0] leads the shared prefill
        self.status = SequenceStatus.WAITING
        # n > 1 (and recomputed beam groups): seqs[1:] join by fork once seqs[0] has computed
        # the shared prefix, so the prompt's blocks are stored once.
        self.forked = False
        self.is_beam = sp.beam_width > 0
        self.max_num_seqs = sp.beam_width if self.is_beam else max(1, sp.n)
        self.beam = None                       # BeamSearch state when is_beam
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[TokenLogprob] | None = (
            [] if sp.prompt_logprobs is not None else None)
        self.first_output_sent = False
        self.next_sample_index = 0
        self.num_preemptions = 0               # times swapped out or dropped to recompute
        # Finish rules, precomputed for the per-token path (lengths count prompt + output):
        self.stop_ids = _shared_stop_ids(sp.stop_token_ids)
        self.min_len = len(request.prompt_token_ids) + sp.min_tokens   # stop tokens count from here
        self.max_len = len(request.prompt_token_ids) + sp.max_tokens   # "length" at this many

    def new_seq(self, seq_id: int, tokens: list[int], prompt_len: int) -> Sequence:
        """A new sequence of this request (its next sample index), not yet in `seqs`."""
        seq = Sequence(seq_id, self, tokens, prompt_len, self.next_sample_index)
        self.next_sample_index += 1
        if self.sampling.logprobs is not None:
            seq.logprobs = []
        return seq

    def to_recompute(self) -> None:
        """Back to waiting, its seqs to be computed again from their tokens (the seqs' blocks
        are already freed): they fork again, and prompt logprobs not yet sent are computed
        again."""
        for seq in self.seqs:
            seq.status = SequenceStatus.WAITING
        self.forked = False
        self.status = SequenceStatus.WAITING
        if self.prompt_logprobs is not None and not self.first_output_sent:
            self.prompt_logprobs = []

    @property
    def fork_point(self) -> int:
        """Tokens every seq of the group shares and computes once: the prompt minus its last
        token (each seq computes that one itself, so each gets its own logits to sample)."""
        return self.prompt_len - 1

    @property
    def needs_fork(self) -> bool:
        return not self.forked and len(self.seqs) > 1

    def work(self, budget: int) -> list[tuple[Sequence, int]]:
        """(seq, tokens) to run this step within `budget`. A group not yet forked runs only
        its leader, up to the fork point. A beam group samples all its beams in the same
        step or none (beam selection needs every beam's candidates)."""
        seqs = self.seqs
        if len(seqs) > 1 and not self.forked:
            leader = seqs[0]
            t = min(self.fork_point - leader.num_computed_tokens, budget)
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
        if self.is_beam and not all_sample:
            work = [(s, t - (1 if s.num_computed_tokens + t == len(s.token_ids) else 0))
                    for s, t in work]
            work = [(s, t) for s, t in work if t > 0]
        return work

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, {self.status.name}, seqs={len(self.seqs)})"
