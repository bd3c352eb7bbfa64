"""Sampler: every parameter changes what is drawn; seeded draws ignore the rest of the batch."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from services.executor import cpu_kernels
from services.executor.sampler import SampleRow, Sampler
from shared.messages import SamplingParams

V = 8
DRAWS = 3000


def _rows(n: int, prompt=(5,), outputs=(), **params) -> list[SampleRow]:
    """n rows with the same logits-independent state; seeds differ per row."""
    return [SampleRow(SamplingParams(seed=i, **params), list(prompt) + list(outputs),
                      len(prompt)) for i in range(n)]


def _draw(logits: list[float], n: int = DRAWS, **params) -> Counter:
    x = torch.tensor([logits] * n, dtype=torch.float32)
    return Counter(Sampler(0)(x, _rows(n, **params)).token_ids)


def _probs(logits, temperature=1.0):
    return torch.softmax(torch.tensor(logits) / temperature, -1).tolist()


LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5]


def test_greedy_picks_the_argmax_whatever_the_seed():
    x = torch.tensor([[0.1, 3.0, 2.9, -1.0]] * 5)
    out = Sampler(0)(x, _rows(5, temperature=0.0))
    assert out.token_ids == [1] * 5


def test_temperature_follows_softmax_of_scaled_logits():
    for t in (0.5, 2.0):
        freq = _draw(LOGITS, temperature=t)
        for tok, p in enumerate(_probs(LOGITS, t)):
            assert abs(freq[tok] / DRAWS - p) < 0.03, (t, tok, freq[tok] / DRAWS, p)


def test_top_k_samples_only_the_k_best():
    assert set(_draw(LOGITS, top_k=3)) == {0, 1, 2}
    assert len(_draw(LOGITS)) > 3        # without top_k the tail is drawn too


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    p = _probs(LOGITS)
    cut = p[0] + p[1] + 0.01            # needs token 2 to reach it
    freq = _draw(LOGITS, top_p=cut)
    assert set(freq) == {0, 1, 2}
    kept = p[0] + p[1] + p[2]
    assert abs(freq[0] / DRAWS - p[0] / kept) < 0.03


def test_top_k_and_top_p_combine():
    # top-p applies to the top-k renormalised distribution: 2 of 3 kept tokens.
    p = _probs(LOGITS)[:3]
    share = p[0] / sum(p)
    assert set(_draw(LOGITS, top_k=3, top_p=share + 0.01)) == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    p = _probs(LOGITS)
    min_p = p[3] / p[0] + 1e-3          # token 3 is just below the cut
    assert set(_draw(LOGITS, min_p=min_p)) == {0, 1, 2}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    x = torch.tensor([[2.0, 1.8, -1.0, -1.1]])
    s = Sampler(0)
    # token 0 seen in the prompt: 2.0 / 1.5 < 1.8, so greedy moves to token 1
    assert s(x, [SampleRow(SamplingParams(temperature=0, repetition_penalty=1.5), [0], 1)]
             ).token_ids == [1]
    # penalising negative logits makes them more negative: token 2 (-1.0 * 3) loses to 3
    x = torch.tensor([[-1.0, -1.1, -5.0, -5.0]])
    row = SampleRow(SamplingParams(temperature=0, repetition_penalty=3.0), [0], 1)
    assert s(x, [row]).token_ids == [1]


def test_frequency_penalty_scales_with_output_count_and_ignores_the_prompt():
    x = torch.tensor([[3.0, 2.0, 0.0, 0.0]])
    s = Sampler(0)
    greedy = dict(temperature=0, frequency_penalty=0.4)
    # token 0 in the prompt only: no penalty
    assert s(x, [SampleRow(SamplingParams(**greedy), [0, 0, 0], 3)]).token_ids == [0]
    # twice in the output: 3.0 - 0.8 > 2.0; three times: 3.0 - 1.2 < 2.0
    assert s(x, [SampleRow(SamplingParams(**greedy), [3, 0, 0], 1)]).token_ids == [0]
    assert s(x, [SampleRow(SamplingParams(**greedy), [3, 0, 0, 0], 1)]).token_ids == [1]


def test_presence_penalty_is_flat_once_a_token_appeared_in_the_output():
    x = torch.tensor([[3.0, 2.5, 0.0, 0.0]])
    s = Sampler(0)
    once = SampleRow(SamplingParams(temperature=0, presence_penalty=0.6), [3, 0], 1)
    assert s(x, [once]).token_ids == [1]
    prompt_only = SampleRow(SamplingParams(temperature=0, presence_penalty=0.6), [0, 3], 2)
    assert s(x, [prompt_only]).token_ids == [0]


def test_min_tokens_bans_stop_tokens_until_enough_outputs():
    x = torch.tensor([[5.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[0])
    s = Sampler(0)
    assert s(x, [SampleRow(params, [9, 9], 1)]).token_ids == [1]      # 1 output < 2
    assert s(x, [SampleRow(params, [9, 9, 9], 1)]).token_ids == [0]   # 2 outputs


def test_logit_bias_allowed_tokens_and_bad_words_each_apply_to_their_row_only():
    x = torch.tensor([LOGITS] * 5)
    rows = [SampleRow(SamplingParams(temperature=0), [9], 1),
            SampleRow(SamplingParams(temperature=0, logit_bias={0: -100.0}), [9], 1),
            SampleRow(SamplingParams(temperature=0, logit_bias={6: 100.0, 1: -1.0}), [9], 1),
            SampleRow(SamplingParams(temperature=0, allowed_token_ids=[3, 5]), [9], 1),
            # [0] is banned outright; [2, 1]: token 1 only after a 2 in the output
            SampleRow(SamplingParams(temperature=0, bad_words_ids=[[0], [2, 1]]), [9, 2], 1)]
    out = Sampler(0)(x, rows)
    assert out.token_ids == [0, 1, 6, 3, 2]
    # the reported logprob stays the raw model's (vLLM's default)
    assert out.logprobs[2] == pytest.approx(torch.log_softmax(x[2], -1)[6].item())
    # without the 2 before it, token 1 is allowed
    assert Sampler(0)(x[:1], [SampleRow(SamplingParams(temperature=0, bad_words_ids=[[0], [2, 1]]),
                                        [9, 3], 1)]).token_ids == [1]


def test_seeded_draw_is_independent_of_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(5)
    mine = torch.randn(1, 64, generator=g)
    row = SampleRow(SamplingParams(temperature=1.0, top_p=0.9, seed=42), [1, 2, 3, 4], 2)
    alone = Sampler(0)(mine, [row]).token_ids[0]
    for trial in range(5):
        others = torch.randn(6, 64, generator=g)
        batch = torch.cat([others[:trial], mine, others[trial:]])
        rows = [SampleRow(SamplingParams(temperature=0.7, seed=None if i % 2 else i), [1], 1)
                for i in range(6)]
        rows.insert(trial, row)
        assert Sampler(trial)(batch, rows).token_ids[trial] == alone


def test_seed_sample_index_and_position_all_change_the_draw():
    x = torch.zeros(1, 1000)     # uniform: any change of u changes the token
    s = Sampler(0)

    def draw(seed=1, index=0, outputs=0):
        row = SampleRow(SamplingParams(temperature=1.0, seed=seed), [3] * (1 + outputs), 1, index)
        return s(x, [row]).token_ids[0]

    assert draw() == draw()
    assert draw(seed=2) != draw()
    assert draw(index=1) != draw()
    assert draw(outputs=1) != draw()


def test_unseeded_rows_follow_the_runner_seed():
    x = torch.zeros(4, 1000)
    rows = [SampleRow(SamplingParams(temperature=1.0), [3], 1) for _ in range(4)]
    assert Sampler(7)(x, rows).token_ids == Sampler(7)(x, rows).token_ids
    assert Sampler(7)(x, rows).token_ids != Sampler(8)(x, rows).token_ids


def test_logprob_is_raw_log_softmax_and_top_lists_the_best():
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]])
    row = SampleRow(SamplingParams(temperature=5.0, repetition_penalty=2.0, logprobs=3, seed=3),
                    [1, 1], 1)
    out = Sampler(0)(x, [row])
    raw = torch.log_softmax(x[0], -1)
    assert math.isclose(out.logprobs[0], float(raw[out.token_ids[0]]), rel_tol=1e-6)
    assert [t for t, _ in out.top[0]] == [1, 2, 0]
    assert math.isclose(out.top[0][0][1], float(raw[1]), rel_tol=1e-6)


def test_beam_search_gets_two_candidates_per_beam():
    x = torch.randn(2, 50)
    rows = [SampleRow(SamplingParams(temperature=0, beam_width=3), [1], 1),
            SampleRow(SamplingParams(temperature=0, beam_width=3, logprobs=8), [1], 1)]
    out = Sampler(0)(x, rows)
    assert len(out.top[0]) == 6 and len(out.top[1]) == 8
    assert out.top[0][0][0] == out.token_ids[0]
    assert [v for _, v in out.top[0]] == sorted((v for _, v in out.top[0]), reverse=True)


def test_greedy_logprobs_are_argmax_and_log_softmax():
    """The C greedy pass gives torch's first argmax and log_softmax value, ties included."""
    if cpu_kernels.kernels() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(5)
    for v in (1, 7, 16, 33, 49152):
        x = torch.randn(6, v, generator=g) * 4
        if v > 20:
            x[1, 3] = x[1, v - 2] = x[1].max() + 1       # a tie: the first one wins
            x[2, v - 1] = x[2].max() + 1                  # the maximum in the scalar tail
            x[3, 17] = x[3, 18] = x[3, v // 2 + 16] = x[3].max() + 1   # ties across lanes
        tok, lp = cpu_kernels.greedy_logprobs(x)
        assert tok.tolist() == x.argmax(dim=-1).tolist(), v
        ref = torch.log_softmax(x, dim=-1).gather(1, tok[:, None])[:, 0]
        assert (lp - ref).abs().max() < 1e-5, v


def test_plain_greedy_rows_match_the_general_path():
    """Plain greedy rows take the C pass; a row asking for logprobs sends the batch through
    log_softmax and topk. Tokens and logprobs agree either way."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, 1000, generator=g) * 3
    plain = Sampler(0)(x, _rows(5, temperature=0.0))
    rows = _rows(5, temperature=0.0) + [SampleRow(SamplingParams(temperature=0, logprobs=1),
                                                  [1], 1)]
    general = Sampler(0)(torch.cat([x, x[:1]]), rows)
    assert plain.token_ids == x.argmax(dim=-1).tolist() == general.token_ids[:5]
    assert plain.top == [[]] * 5
    ref = torch.log_softmax(x, -1).gather(1, x.argmax(-1, keepdim=True))[:, 0].tolist()
    assert all(abs(a - b) < 1e-5 for a, b in zip(plain.logprobs, ref))
    assert all(abs(a - b) < 1e-5 for a, b in zip(plain.logprobs, general.logprobs[:5]))
