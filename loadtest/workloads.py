"""Seeded synthetic workloads shaped like the traces of the PagedAttention paper (§6.1).

    ShareGPT-like  prompt and output lengths lognormal, means ≈ 161 and ≈ 338 tokens
    Alpaca-like    prompt and output lengths lognormal, means ≈ 19 and ≈ 58 tokens

Lengths are redrawn until prompt + output fits max_len (the paper filters its traces the same
way), so the means stay close to the targets. Token ids are drawn from the ordinary range of
the vocabulary (special tokens at both ends are avoided). Same seed, same workload.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LengthModel:
    name: str
    prompt_mean: float      # tokens, of the lognormal before the max_len filter
    output_mean: float      # tokens, likewise
    prompt_sigma: float     # of the underlying normal (shape of the tail)
    output_sigma: float


# NOTE: the ShareGPT means are set a little above the paper's 161 / 338 because dropping the
# pairs longer than 2048 tokens trims the tail; after the filter they come out at ≈161 / ≈337.
SHAREGPT = LengthModel("sharegpt", 163.0, 350.0, 0.9, 0.8)
ALPACA = LengthModel("alpaca", 19.0, 58.0, 0.6, 0.8)
WORKLOADS = {m.name: m for m in (SHAREGPT, ALPACA)}


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    # mean of a lognormal = exp(mu + sigma^2 / 2)
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def sample_lengths(model: LengthModel, n: int, seed: int = 0, scale: float = 1.0,
                   max_len: int = 2048) -> list[tuple[int, int]]:
    """n (prompt_len, output_len) pairs, each >= 1, with prompt_len + output_len <= max_len."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        p = max(1, round(_lognormal(rng, model.prompt_mean, model.prompt_sigma) * scale))
        o = max(1, round(_lognormal(rng, model.output_mean, model.output_sigma) * scale))
        if p + o <= max_len:
            out.append((p, o))
    return out


def make_requests(model: LengthModel, n: int, seed: int = 0, scale: float = 1.0,
                  max_len: int = 2048, vocab: int = 49152,
                  system_prompt_len: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length) pairs. With system_prompt_len > 0 every prompt
    starts with the same system prompt of that many tokens (the prefix-caching case)."""
    rng = random.Random(seed + 1)
    lo, hi = 100, max(101, vocab - 100)
    system = [rng.randrange(lo, hi) for _ in range(system_prompt_len)]
    reqs = []
    for p, o in sample_lengths(model, n, seed, scale, max_len - system_prompt_len):
        reqs.append((system + [rng.randrange(lo, hi) for _ in range(p)], o))
    return reqs


def sharegpt_like(n: int, seed: int = 0, scale: float = 1.0, max_len: int = 2048,
                  vocab: int = 49152) -> list[tuple[list[int], int]]:
    return make_requests(SHAREGPT, n, seed, scale, max_len, vocab)


def alpaca_like(n: int, seed: int = 0, scale: float = 1.0, max_len: int = 2048,
                vocab: int = 49152) -> list[tuple[list[int], int]]:
    return make_requests(ALPACA, n, seed, scale, max_len, vocab)


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds from 0) of a Poisson process of `rate` requests per second."""
    rng = random.Random(seed + 2)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        out.append(t)
    return out


def random_prompts(n: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    """n prompts of 32-256 token ids drawn uniformly from the ordinary range of the
    vocabulary (the benchmarks that compare systems on one fixed set of prompts)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 256))]
            for _ in range(n)]
