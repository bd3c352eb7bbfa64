"""A deterministic stand-in for the executor that keeps the StepPlan contract to the letter.

It holds its own GPU and CPU pools where every slot stores the token id written there, keeps
per-seq state only from the plans' diffs, applies swap_out, swap_in and copy in that order,
writes each scheduled token's id into the slot its block table names, and derives the next
token from the context READ BACK FROM ITS POOL through the block table. A wrong block table,
a missed copy-on-write or a bad swap therefore changes the output (and, with `check`, fails
at once with the seq and step where the cache went wrong).

The "model": next token = a hash of the context read back, so a request's output depends only
on its own tokens, never on batching, preemption or which physical blocks it got.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.messages import SamplingParams, StepPlan, StepResult, TokenLogprob

VOCAB = 64            # small, so that stop tokens are hit now and then


class PlanError(AssertionError):
    pass


@dataclass(slots=True)
class _Seq:
    request_id: str
    tokens: list[int]
    prompt_len: int
    table: list[int]
    sampling: SamplingParams
    sample_index: int
    computed: int          # positions this executor has written (or was told are cached)
    last: int = -1         # the token sampled for it in its last step (a -1 appended stands
                           # for it: a plan planned ahead, services/scheduler/ahead.py)


def _mix(x: int) -> int:
    x = (x ^ (x >> 33)) * 0xFF51AFD7ED558CCD & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53 & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 33)


def context_hash(ctx: tuple[int, ...]) -> int:
    return _mix(hash(ctx) & 0xFFFFFFFFFFFFFFFF)


def next_token(ctx: tuple[int, ...], sample_index: int) -> tuple[int, float]:
    h = _mix(context_hash(ctx) ^ (sample_index * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF))
    return h % VOCAB, -((h >> 16) % 4000) / 1000.0


def candidates(ctx: tuple[int, ...], k: int) -> list[list]:
    """k distinct [token, logprob] pairs, best first (a stand-in for the top-k of log_softmax)."""
    h = context_hash(ctx)
    out, seen, i = [], set(), 0
    while len(out) < k:
        x = _mix(h + i)
        i += 1
        tok = x % VOCAB
        if tok in seen:
            continue
        seen.add(tok)
        out.append([tok, -((x >> 20) % 5000) / 1000.0 - 0.001])
    out.sort(key=lambda p: -p[1])
    return out


def prompt_logprob(ctx: tuple[int, ...]) -> float:
    return -(context_hash(ctx) % 3000) / 1000.0


class FakeExecutor:
    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 check: bool = True, script: dict[str, list[int]] | None = None) -> None:
        """`script`: request id -> the tokens its seqs sample, in order (instead of the hash)."""
        self.script = script or {}
        self.bs = block_size
        self.gpu = [[-1] * block_size for _ in range(num_gpu_blocks)]
        self.cpu = [[-1] * block_size for _ in range(max(1, num_cpu_blocks))]
        self.seqs: dict[int, _Seq] = {}
        self.check = check
        self.steps = 0

    def _read(self, seq: _Seq, n: int) -> tuple[int, ...]:
        bs = self.bs
        ctx: list[int] = []
        for j in range((n + bs - 1) // bs):
            ctx.extend(self.gpu[seq.table[j]])
        return tuple(ctx[:n])

    def execute(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        for sid in plan.finished_seq_ids:
            if sid not in self.seqs:
                raise PlanError(f"step {plan.step_id}: drop of unknown seq {sid}")
            del self.seqs[sid]
        for ns in plan.new_seqs:
            if ns.seq_id in self.seqs:
                raise PlanError(f"step {plan.step_id}: NewSeq {ns.seq_id} is already known")
            self.seqs[ns.seq_id] = _Seq(ns.request_id, list(ns.token_ids), ns.prompt_len,
                                        list(ns.block_table), ns.sampling, ns.sample_index, -1)
        rows = list(zip(plan.seq_ids, plan.num_computed_tokens, plan.num_tokens,
                        plan.appended_per_row(), plan.block_keep, plan.block_append))
        if len(set(plan.seq_ids)) != len(rows):
            raise PlanError(f"step {plan.step_id}: a seq has two rows")
        for sid, computed, n, append, keep, blocks in rows:
            seq = self.seqs.get(sid)
            if seq is None:
                raise PlanError(f"step {plan.step_id}: scheduled unknown seq {sid}")
            if append and append[0] < 0:
                if len(append) != 1 or seq.last < 0:
                    raise PlanError(f"step {plan.step_id}: seq {sid} appends {append}, but "
                                    "it sampled nothing in its last step")
                append = [seq.last]
            seq.tokens.extend(append)
            if keep >= 0:
                del seq.table[keep:]
            seq.table.extend(blocks)
            if seq.computed < 0:              # new: trusts the plan for cached/forked positions
                seq.computed = computed
            elif seq.computed != computed:
                raise PlanError(f"step {plan.step_id}: seq {sid} starts at "
                                f"{computed}, but {seq.computed} are computed")
            end = computed + n
            if n < 1 or end > len(seq.tokens):
                raise PlanError(f"step {plan.step_id}: seq {sid} chunk "
                                f"[{computed}, {end}) outside its {len(seq.tokens)} tokens")
            if len(seq.table) * self.bs < end:
                raise PlanError(f"step {plan.step_id}: seq {sid} table too short")
        # Cache operations, in the contract's order.
        for g, c in plan.swap_out:
            self.cpu[c] = list(self.gpu[g])
        for c, g in plan.swap_in:
            self.gpu[g] = list(self.cpu[c])
        for src, dst in plan.copy:
            self.gpu[dst] = list(self.gpu[src])
        # Forward: every scheduled token's id goes to its slot, then each seq reads back.
        bs = self.bs
        for sid, computed, n, *_ in rows:
            seq = self.seqs[sid]
            for pos in range(computed, computed + n):
                self.gpu[seq.table[pos // bs]][pos % bs] = seq.tokens[pos]
            seq.computed = computed + n
        result = StepResult(plan.step_id)
        prompt_lps = []
        for r, (sid, computed, *_) in enumerate(rows):
            seq = self.seqs[sid]
            end = seq.computed
            ctx = self._read(seq, end)
            if self.check and list(ctx) != seq.tokens[:end]:
                bad = next(i for i, (a, b) in enumerate(zip(ctx, seq.tokens)) if a != b)
                raise PlanError(f"step {plan.step_id}: seq {sid} ({seq.request_id}) reads "
                                f"token {ctx[bad]} at position {bad}, wrote {seq.tokens[bad]}")
            sp = seq.sampling
            lo, hi = max(computed, 1), min(end, seq.prompt_len)
            prompt_lps.append([TokenLogprob(ctx[p], prompt_logprob(ctx[:p + 1]))
                               for p in range(lo, hi)] if sp.prompt_logprobs is not None else [])
            if (end == len(seq.tokens)) != (r < plan.num_sampling_rows):
                raise PlanError(f"step {plan.step_id}: row {r} (seq {sid}) is on the wrong "
                                "side of num_sampling_rows")
            if r >= plan.num_sampling_rows:
                continue
            top: list = []
            if sp.beam_width > 0:
                top = candidates(ctx, max(2 * sp.beam_width, sp.logprobs or 0))
                token, logprob = top[0]
            else:
                token, logprob = next_token(ctx, seq.sample_index)
                script = self.script.get(seq.request_id)
                if script is not None:
                    token = script[len(seq.tokens) - seq.prompt_len]
                if sp.logprobs:
                    top = candidates(ctx, sp.logprobs)
            seq.last = token
            result.token_ids.append(token)
            result.logprobs.append(logprob)
            result.top.append(top)
        if not any(result.top):
            result.top = []
        if any(prompt_lps):
            result.prompt_logprobs = prompt_lps
        return result
