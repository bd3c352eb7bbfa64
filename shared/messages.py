"""Every message that crosses a process boundary, declared once.

Wires (see ../DESIGN.md):

    gateway ──GenerationRequest──▶ Redis ──▶ scheduler          (request stream)
    gateway ──AbortRequest───────▶ Redis ──▶ scheduler          (abort stream)
    scheduler ──RequestOutput────▶ Redis ──▶ gateway            (out:{request_id} stream)
    scheduler ──StepPlan─────────▶ ZeroMQ ─▶ executor rank 0..N
    executor rank 0 ──StepResult─▶ ZeroMQ ─▶ scheduler

Units: token counts are tokens, block ids index the physical pool of the executor
(GPU pool for block tables and copy ops, CPU pool on the CPU side of swap pairs).
Encode/decode with `shared.wire.encode` / `shared.wire.decode`.
"""
from __future__ import annotations

from dataclasses import field

from shared.wire import message

# ---------------------------------------------------------------- requests (gateway → scheduler)


@message
class SamplingParams:
    """Per-request sampling parameters, validated by the gateway before enqueueing."""

    n: int = 1                       # parallel samples (ignored when beam_width > 0)
    beam_width: int = 0              # > 0: beam search of this width; returns `n` best beams
    length_penalty: float = 1.0      # beam search: score = logprob_sum / len ** length_penalty
    temperature: float = 1.0         # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                   # 0 = disabled
    min_p: float = 0.0
    seed: int | None = None          # reproducible per request, whatever else is batched
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16             # new tokens per sequence
    min_tokens: int = 0              # stop tokens are ignored before this many new tokens
    stop_token_ids: list[int] = field(default_factory=list)  # includes EOS unless ignore_eos
    logprobs: int | None = None      # top-k logprobs per sampled token (0 = only the sampled one)
    prompt_logprobs: int | None = None


@message
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0                # lower value = more important (vLLM convention)
    arrival_time: float = 0.0        # unix seconds, set by the gateway


@message
class AbortRequest:
    request_id: str
    reason: str = "abort"
    index: int = -1                  # one sequence (0..n-1) of the request; -1: all of it


# ---------------------------------------------------------------- outputs (scheduler → gateway)


@message
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[list] = field(default_factory=list)   # [[token_id, logprob], ...] best first


@message
class SeqDelta:
    """What one output sequence (index 0..n-1) gained since the last RequestOutput."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when requested
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    stop_token_id: int | None = None   # the stop token that ended it (not in token_ids)
    cumulative_logprob: float = 0.0


@message
class RequestOutput:
    """One step's news for one request, appended to its output stream."""

    request_id: str
    seqs: list[SeqDelta]
    finished: bool = False             # every sequence of the request has finished
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0         # prompt tokens served from the prefix cache
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only
    error: str | None = None           # set when the request was refused or failed
    error_code: int = 0                # HTTP-ish status for `error` (400 refused, 500 internal)


# ---------------------------------------------------------------- step plan (scheduler → executors)


@message
class NewSeq:
    """A sequence the executors do not know yet (admitted, forked, or resumed by recompute).

    The executors keep it, updated by `ScheduledSeq` diffs, until its id appears in
    `StepPlan.finished_seq_ids`.
    """

    seq_id: int
    request_id: str
    token_ids: list[int]             # prompt + any output so far
    prompt_len: int                  # token_ids[:prompt_len] is the prompt
    block_table: list[int]           # logical block i -> physical GPU block
    sampling: SamplingParams
    sample_index: int = 0            # index in its request's group (seeds differ per index)


@message
class ScheduledSeq:
    """One sequence's work in this step.

    Block table diff, applied first: truncate to `block_keep` entries (-1: keep all), then
    append `block_append`. This covers growth (append), copy-on-write of the last block
    (keep len-1, append the copy) and swap-in (keep 0, append the new table).
    """

    seq_id: int
    num_computed_tokens: int         # tokens of this seq whose KV is already in the cache
    num_tokens: int                  # tokens to run this step: a prefill chunk, or 1 to decode
    append_token_ids: list[int] = field(default_factory=list)  # tokens added since last step
    block_keep: int = -1
    block_append: list[int] = field(default_factory=list)
    # Sampling happens iff num_computed_tokens + num_tokens == len(tokens) after appending.


@message
class StepPlan:
    step_id: int
    new_seqs: list[NewSeq] = field(default_factory=list)
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # Cache operations, applied before the forward, in this order:
    swap_out: list[list[int]] = field(default_factory=list)   # [[gpu_block, cpu_block], ...]
    swap_in: list[list[int]] = field(default_factory=list)    # [[cpu_block, gpu_block], ...]
    copy: list[list[int]] = field(default_factory=list)       # [[src_gpu, dst_gpu], ...]
    finished_seq_ids: list[int] = field(default_factory=list)  # drop state (finished/preempted)


# ---------------------------------------------------------------- step result (executor → scheduler)


@message
class SeqSample:
    seq_id: int
    token_id: int                    # sampled token; -1 when the seq did not sample this step
    logprob: float = 0.0             # log_softmax of the raw model logits (before penalties/temperature)
    top: list[list] = field(default_factory=list)  # [[token_id, logprob], ...]: max(logprobs, 2*beam_width)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per prompt position
    # computed this step, when requested (position 0 has none and is not included)


@message
class StepResult:
    step_id: int
    samples: list[SeqSample] = field(default_factory=list)
    error: str | None = None
    forward_ms: float = 0.0
