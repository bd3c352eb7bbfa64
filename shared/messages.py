"""Every message that crosses a process boundary, declared once.

Wires (docs/design.md walks one request through all of them):

    gateway ──GenerationRequest──▶ Redis ──▶ scheduler          (request stream)
    gateway ──AbortRequest───────▶ Redis ──▶ scheduler          (abort stream)
    gateway ──StreamHeader───────▶ Redis ──▶ gateway            (out:{request_id}, first entry)
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
class OutputConstraint:
    """A grammar every output sequence must follow (structured outputs, tool calls).

    The gateway checks it compiles before queueing; the scheduler keeps one matcher per
    sequence and ships each step's allowed tokens as a bitmask (StepPlan.token_bitmask)."""

    kind: str                        # "json_schema" | "regex" | "choice" | "grammar" (Lark/GBNF)
    spec: str                        # the schema as JSON text, the regex, a JSON list of
                                     # choices, or the grammar text


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
    # Logits processing, applied before penalties and sampling (the reported logprobs stay
    # those of the raw logits, as in vLLM):
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None   # every other token is banned (-inf)
    bad_words_ids: list[list[int]] = field(default_factory=list)  # token sequences never completed
    constraint: OutputConstraint | None = None   # grammar the output follows (the scheduler
                                                 # masks the logits through StepPlan)


@message
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0                # lower value = more important (vLLM convention)
    arrival_time: float = 0.0        # unix seconds, set by the gateway
    # Whose request: an opaque id the gateway derives from the client's API key (a hash,
    # never the key), the unit of the scheduler's fair admission; "" for untagged requests.
    tenant: str = ""


def token_cost(req: GenerationRequest) -> int:
    """Tokens a request may hold in the KV cache at its end: its prompt plus max_tokens for
    each sequence it runs (n, or the beam width). The gateway's per-key budgets and the
    scheduler's fair shares both count in it."""
    sp = req.sampling
    return len(req.prompt_token_ids) + max(1, sp.beam_width or sp.n) * sp.max_tokens


@message
class AbortRequest:
    request_id: str
    reason: str = "abort"
    index: int = -1                  # one sequence (0..n-1) of the request; -1: all of it


@message
class StreamHeader:
    """The first entry of a request's output stream: all a gateway needs, besides the outputs,
    to answer (or replay, for a resuming client on any replica) the request's response."""

    kind: str                        # "completion" | "chat"
    request_id: str                  # the id of the response (several prompts share it)
    model: str                       # the served name echoed in the response
    created: int                     # unix seconds
    n: int                           # choices of this prompt (beams returned with beam search)
    prompt_tokens: int
    stream: bool = False
    include_usage: bool = False      # stream_options.include_usage
    continuous_usage: bool = False   # stream_options.continuous_usage_stats: usage on every chunk
    resumable: bool = False          # event ids, keep-alives, survives a drop (opt-in)
    logprobs: int | None = None      # top-k per token; None: no logprobs
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0              # stop strings apply from this many new tokens on (vLLM)
    prompt_index: int = 0            # choices are numbered prompt_index * n + j
    echo: bool = False               # completions: the prompt's text (and logprobs) first
    prompt_token_ids: list[int] = field(default_factory=list)  # kept only with echo
    hide_output: bool = False        # max_tokens 0: the one token run is not shown or counted
    prompt_logprobs: int | None = None  # vLLM's choices[i].prompt_logprobs (top-k)
    tokens_as_ids: bool = False      # logprob tokens written "token_id:<id>" (vLLM)
    tool_calls: bool = False         # chat with tools: <tool_call> blocks become tool_calls


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

    The executors keep it, updated by the plan's row diffs, until its id appears in
    `StepPlan.finished_seq_ids`. A new sequence that runs this step also has a row.
    """

    seq_id: int
    request_id: str
    token_ids: list[int]             # prompt + any output so far
    prompt_len: int                  # token_ids[:prompt_len] is the prompt
    block_table: list[int]           # logical block i -> physical GPU block
    sampling: SamplingParams
    sample_index: int = 0            # index in its request's group (seeds differ per index)


@message
class StepPlan:
    """One iteration's work for the executors. Columnar: row r of the step is the r-th entry
    of every per-row list (parallel lists, no object per sequence).

        row r   seq_ids  num_computed_tokens  num_tokens  num_append_tokens  block_keep  block_append
        ─────   ───────  ───────────────────  ──────────  ─────────────────  ──────────  ────────────
        0       12       300                  1           1                  -1          []
        1       40       64                   1           1                  -1          [95]
        2       41       0                    37          0                  -1          []
                 ▲ rows < num_sampling_rows sample one token; rows ≥ it are prefill chunks
                   that stop short of their sequence's end (their tokens are not sampled)

        append_token_ids  [873, 11]    every row's appended tokens, concatenated in row order

    Per row, applied first: append its `num_append_tokens[r]` tokens of `append_token_ids`
    (tokens added since the executors last saw the seq: for a decode, the token sampled in
    the step before; `appended_per_row()` splits them; a decode's one token may be -1: the
    token the executor sampled for that seq in its last step, for a plan sent before that
    step's result came back, services/scheduler/ahead.py), then the block-table diff: truncate
    to `block_keep` entries (-1: keep all),
    then append `block_append`. That covers growth (append), copy-on-write of the last block
    (keep len-1, append the copy) and swap-in (keep 0, append the new table). Then the row
    runs tokens [num_computed_tokens, num_computed_tokens + num_tokens) of its seq.

    Rows that sample come first, decodes (num_tokens == 1) first among them, so the executor
    runs the rows in plan order and `StepResult.token_ids[r]` answers row r. A row samples
    iff num_computed_tokens + num_tokens == its seq's length after appending.
    """

    step_id: int
    new_seqs: list[NewSeq] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # tokens with KV in the cache
    num_tokens: list[int] = field(default_factory=list)           # tokens to run (chunk or 1)
    num_append_tokens: list[int] = field(default_factory=list)
    # NOTE: flat, not a list per row: a decode row appends one token, and one list object per
    # row per step is most of what building and decoding a plan allocates.
    append_token_ids: list[int] = field(default_factory=list)
    block_keep: list[int] = field(default_factory=list)
    block_append: list[list[int]] = field(default_factory=list)
    num_sampling_rows: int = 0
    # Cache operations, applied before the forward, in this order:
    swap_out: list[list[int]] = field(default_factory=list)   # [[gpu_block, cpu_block], ...]
    swap_in: list[list[int]] = field(default_factory=list)    # [[cpu_block, gpu_block], ...]
    copy: list[list[int]] = field(default_factory=list)       # [[src_gpu, dst_gpu], ...]
    finished_seq_ids: list[int] = field(default_factory=list)  # drop state (finished/preempted)
    # Grammar-constrained sampling rows: the plan rows (all < num_sampling_rows, ascending)
    # and, for each, the allowed tokens of its next sample as a bitmask: little-endian
    # int32 words, bit b of word w allows token 32 * w + b; every row has
    # `bitmask_words` words, concatenated in row order. Unconstrained rows carry nothing.
    bitmask_rows: list[int] = field(default_factory=list)
    bitmask_words: int = 0
    token_bitmask: bytes = b""
    fence: int = 0          # the sender's fencing token (Reset); an executor refuses others

    def appended_per_row(self) -> list[list[int]]:
        """Each row's appended tokens: `append_token_ids` split by `num_append_tokens`.
        Raises ValueError when the counts do not add up to the tokens."""
        tokens = self.append_token_ids
        if sum(self.num_append_tokens) != len(tokens):
            raise ValueError(f"num_append_tokens add up to {sum(self.num_append_tokens)}, "
                             f"append_token_ids holds {len(tokens)}")
        rows = []
        start = 0
        for n in self.num_append_tokens:
            rows.append(tokens[start:start + n])
            start += n
        return rows


# ---------------------------------------------------------------- step result (executor → scheduler)


@message
class StepResult:
    """The answer to the StepPlan with the same step_id. Positional: entry r of each list
    belongs to row r of the plan (no seq ids travel back)."""

    step_id: int
    token_ids: list[int] = field(default_factory=list)   # one per sampling row
    # log_softmax of the raw model logits (before penalties/temperature), one per sampling row:
    logprobs: list[float] = field(default_factory=list)
    # Empty when no row asked for candidates; else one per sampling row:
    # [[token_id, logprob], ...] best first, max(logprobs, 2 * beam_width) of them.
    top: list[list[list]] = field(default_factory=list)
    # Empty when no row asked for prompt logprobs; else one list per plan row: the prompt
    # positions that row computed (position 0 has none and is not included).
    prompt_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    error: str | None = None         # the step failed: nothing above is valid
    forward_ms: float = 0.0
