"""Batched sampling from the logits of the rows that sample this step.

Per row, in this order (vLLM semantics):

    raw logits ──log_softmax──▶ reported logprob, top candidates
        │
        ├─ grammar bitmask (the scheduler's, constrained rows only): disallowed tokens banned
        ├─ allowed_token_ids: every other token banned
        ├─ logit_bias added; bad words' last tokens banned where the output ends in the rest
        ├─ stop tokens banned while fewer than min_tokens outputs exist
        ├─ repetition penalty over prompt+output tokens (x / p if x > 0 else x * p)
        ├─ frequency * count + presence * [count > 0] subtracted, over output tokens
        ├─ temperature 0 ─▶ argmax
        └─ / temperature ─▶ softmax ─▶ min-p ─▶ top-k ─▶ top-p ─▶ inverse-CDF draw with u

Seeded requests draw `u` from a hash of (seed, sample_index, output position), not from
a stateful generator: the draw depends only on the row itself, so it is the same whatever
else is in the batch and after the sequence was preempted and recomputed. Unseeded rows
take u from the runner's generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.executor import cpu_kernels
from shared.messages import SamplingParams

_MASK64 = (1 << 64) - 1
_GREEDY_EPS = 1e-5     # temperatures below this are greedy


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs to know about one sampling sequence."""

    params: SamplingParams
    token_ids: list[int]      # prompt + outputs so far
    prompt_len: int
    sample_index: int = 0

    @property
    def output_len(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass(slots=True)
class TokenMask:
    """The plan's grammar bitmasks (shared/messages.py, StepPlan.token_bitmask): for sampling
    row rows[j], bit b of int32 word w of mask j allows token 32 * w + b."""

    rows: list[int]
    words: int
    bits: bytes

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` [R, V] whose masked rows have -inf where the grammar bans.

        The packed bytes go to the device as they are (8x less to copy than a bool mask)
        and are unpacked there by one row gather from a [256, 8] table of additive masks
        (byte v -> 0.0 where bit k of v is set, -inf where not), added to the logits:
        little-endian words make byte i hold tokens 8i..8i+7, bit k token 8i+k. x + 0.0 is
        x, so an allowed logit is never changed. Tokens past the mask's width (logits
        padded beyond the tokenizer's vocabulary) are banned.
        NOTE: index_select of table rows is ~10x faster on the CPU than indexing a bool
        table with the bytes and a torch.where (both one op on CUDA)."""
        n, vocab = len(self.rows), logits.shape[1]
        dev = logits.device
        nbytes = -(-vocab // 8)
        packed = torch.frombuffer(bytearray(self.bits), dtype=torch.uint8).view(n, 4 * self.words)
        if packed.shape[1] < nbytes:
            packed = torch.nn.functional.pad(packed, (0, nbytes - packed.shape[1]))
        packed = packed[:, :nbytes].to(dev, non_blocking=True)
        add = _additive_bits(dev, logits.dtype).index_select(0, packed.reshape(-1).int())
        add = add.view(n, 8 * nbytes)[:, :vocab]
        if self.rows == list(range(logits.shape[0])):
            return logits + add
        x = logits.clone()
        at = torch.tensor(self.rows, device=dev)
        x[at] = x[at] + add
        return x


_ADDITIVE_BITS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _additive_bits(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8] of `dtype`: entry [v, k] is 0 when bit k of byte v is set (token allowed),
    -inf when it is not."""
    table = _ADDITIVE_BITS.get((device, dtype))
    if table is None:
        v = torch.arange(256, dtype=torch.int32)[:, None]
        banned = ((v >> torch.arange(8, dtype=torch.int32)) & 1) == 0
        table = _ADDITIVE_BITS[(device, dtype)] = torch.where(
            banned, float("-inf"), 0.0).to(device=device, dtype=dtype)
    return table


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]          # raw log_softmax of the sampled token
    top: list[list[list]]          # per row: [[token_id, logprob], ...] best first


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, sample_index: int, position: int) -> float:
    """A uniform draw in [0, 1) that depends only on its three arguments."""
    h = _splitmix64((seed & _MASK64) ^ _splitmix64(sample_index ^ _splitmix64(position)))
    return (h >> 11) * 2.0 ** -53


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow],
                 mask: TokenMask | None = None) -> SampleOutput:
        """Sample one token per row of fp32 logits [R, V] (CPU or GPU); `mask` bans what
        the grammar of each constrained row does not allow (the logprobs stay raw)."""
        x = self._constrained_logits(logits, rows, mask)
        if (x is logits and logits.device.type == "cpu" and logits.dtype == torch.float32
                and cpu_kernels.kernels() is not None
                and all(r.params.temperature < _GREEDY_EPS and not r.params.logprobs
                        and not r.params.beam_width for r in rows)):
            # Plain greedy rows on the CPU: one pass per row in C, no [R, V] log_softmax.
            tokens, chosen = cpu_kernels.greedy_logprobs(logits)
            return SampleOutput(tokens.tolist(), chosen.tolist(), [[] for _ in rows])
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.params.temperature < _GREEDY_EPS]
        rand = [i for i, r in enumerate(rows) if r.params.temperature >= _GREEDY_EPS]
        if greedy:
            # NOTE: max(dim).indices, not argmax: the same first maximum, 2.7x faster on the
            # CPU for [64, 49152]; and no row copy when every row is greedy.
            xg = x if len(greedy) == len(rows) else x[greedy]
            tokens[greedy] = xg.max(dim=-1).indices
        if rand:
            tokens[rand] = self._sample(x[rand], [rows[i] for i in rand])
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]
        ks = [max(r.params.logprobs or 0, 2 * r.params.beam_width) for r in rows]
        top = [[] for _ in rows]
        if max(ks):
            vals, idx = logprobs.topk(min(max(ks), logprobs.shape[1]), dim=-1)
            vals, idx = vals.tolist(), idx.tolist()
            top = [[[t, v] for t, v in zip(idx[i][:k], vals[i][:k])] for i, k in enumerate(ks)]
        return SampleOutput(tokens.tolist(), chosen.tolist(), top)

    # ------------------------------------------------------------------ logits processing

    def _constrained_logits(self, logits: torch.Tensor, rows: list[SampleRow],
                            mask: TokenMask | None = None) -> torch.Tensor:
        """Logits with token masks, biases, min_tokens bans and penalties applied (a copy
        only if anything applies). Every kind is one batched tensor operation."""
        allowed = [i for i, r in enumerate(rows) if r.params.allowed_token_ids]
        bias_at: tuple[list[int], list[int], list[float]] = ([], [], [])
        banned: tuple[list[int], list[int]] = ([], [])
        for i, r in enumerate(rows):
            p = r.params
            for t, b in p.logit_bias.items():
                bias_at[0].append(i)
                bias_at[1].append(t)
                bias_at[2].append(b)
            if p.stop_token_ids and r.output_len < p.min_tokens:
                banned[0].extend([i] * len(p.stop_token_ids))
                banned[1].extend(p.stop_token_ids)
            for t in _bad_word_ends(r):
                banned[0].append(i)
                banned[1].append(t)
        pen = [i for i, r in enumerate(rows)
               if r.params.repetition_penalty != 1.0 or r.params.presence_penalty != 0.0
               or r.params.frequency_penalty != 0.0]
        if not (mask or allowed or bias_at[0] or banned[0] or pen):
            return logits
        # The grammar mask is one batched op over the constrained rows; it leaves allowed
        # logits as they are (greedy picks the unconstrained token whenever it is allowed).
        x = mask.apply(logits) if mask else logits.clone()
        dev = x.device
        if allowed:
            keep = torch.zeros((len(allowed), x.shape[1]), dtype=torch.bool)
            for j, i in enumerate(allowed):
                keep[j, rows[i].params.allowed_token_ids] = True
            x[allowed] = x[allowed].masked_fill(~keep.to(dev), float("-inf"))
        if bias_at[0]:
            at = (torch.tensor(bias_at[0], device=dev), torch.tensor(bias_at[1], device=dev))
            x.index_put_(at, torch.tensor(bias_at[2], dtype=x.dtype, device=dev), accumulate=True)
        if banned[0]:
            at = (torch.tensor(banned[0], device=dev), torch.tensor(banned[1], device=dev))
            x[at] = float("-inf")
        if pen:
            x[pen] = self._penalised(x[pen], [rows[i] for i in pen])
        return x

    @staticmethod
    def _penalised(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        n, vocab = x.shape
        dev = x.device
        # Padded token matrix; the pad id `vocab` lands in a spare column that is dropped.
        longest = max(len(r.token_ids) for r in rows)
        toks = torch.full((n, longest), vocab, dtype=torch.int64)
        is_out = torch.zeros((n, longest), dtype=torch.float32)
        for j, r in enumerate(rows):
            toks[j, :len(r.token_ids)] = torch.tensor(r.token_ids, dtype=torch.int64)
            is_out[j, r.prompt_len:len(r.token_ids)] = 1.0
        toks, is_out = toks.to(dev), is_out.to(dev)
        seen = torch.zeros((n, vocab + 1), dtype=torch.bool, device=dev)
        seen.scatter_(1, toks, True)
        counts = torch.zeros((n, vocab + 1), dtype=torch.float32, device=dev)
        counts.scatter_add_(1, toks, is_out)
        seen, counts = seen[:, :vocab], counts[:, :vocab]
        def col(vals: list[float]) -> torch.Tensor:
            return torch.tensor(vals, dtype=torch.float32, device=dev)[:, None]

        rep = col([r.params.repetition_penalty for r in rows])
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - col([r.params.frequency_penalty for r in rows]) * counts
        return x - col([r.params.presence_penalty for r in rows]) * (counts > 0)

    # ------------------------------------------------------------------ random sampling

    def _sample(self, x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        dev = x.device

        def col(vals: list, dt: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(vals, dtype=dt, device=dev)[:, None]

        probs = torch.softmax(x / col([r.params.temperature for r in rows]), dim=-1)
        min_p = [r.params.min_p for r in rows]
        if any(min_p):
            # keep tokens at least min_p times as likely as the most likely one
            cut = col(min_p) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < cut, 0.0)
        u = col(self._uniforms(rows), torch.float64)
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if not any(top_k) and all(p >= 1.0 for p in top_p):
            return _inverse_cdf(probs.double(), u)
        # Sort once; top-k and top-p both cut a prefix of the sorted distribution.
        if all(top_k):
            sp, si = probs.topk(min(max(top_k), probs.shape[1]), dim=-1)
        else:
            sp, si = probs.sort(dim=-1, descending=True)
        sp = sp.double()
        rank = torch.arange(sp.shape[1], device=dev)[None, :]
        k = col([k if k > 0 else sp.shape[1] for k in top_k], torch.int64)
        sp = sp.masked_fill(rank >= k, 0.0)
        # top-p over the top-k renormalised distribution; the first token always stays.
        sp = sp / sp.sum(dim=-1, keepdim=True)
        before = sp.cumsum(dim=-1) - sp
        sp = sp.masked_fill(before >= col(top_p, torch.float64), 0.0)
        return si.gather(1, _inverse_cdf(sp, u)[:, None])[:, 0]

    def _uniforms(self, rows: list[SampleRow]) -> list[float]:
        free = torch.rand(len(rows), generator=self.generator, dtype=torch.float64).tolist()
        return [free[i] if r.params.seed is None
                else seeded_uniform(r.params.seed, r.sample_index, r.output_len)
                for i, r in enumerate(rows)]


def _bad_word_ends(r: SampleRow) -> list[int]:
    """The tokens that would complete one of r's bad words now: a one-token word always,
    a longer one when the output so far ends with all of the word but its last token."""
    out = []
    for word in r.params.bad_words_ids:
        *head, last = word
        if not head or (len(head) <= r.output_len and r.token_ids[-len(head):] == head):
            out.append(last)
    return out


def _inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of unnormalised weights p [R, N] (float64) with u [R, 1]."""
    cdf = p.cumsum(dim=-1)
    target = u * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    # A zero weight never wins (its cdf equals its left neighbour's). u * total < total, so
    # idx < N; rounding at the very end could still reach N, so cap at the last nonzero one.
    last = p.shape[1] - 1 - (p > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(idx, last)
