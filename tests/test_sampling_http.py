"""Sampling parameters and beam search, sent over HTTP to the real stack (gateway, Redis,
scheduler, executor, SmolLM2 on the CPU): each mapping must reach the scheduler and change
what it generates the way the OpenAI/vLLM parameter says."""
from __future__ import annotations

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The history of the Roman Empire began"


@pytest.fixture(scope="module")
def complete(stack):
    client = httpx.Client(base_url=stack.base_url, timeout=300)

    def call(**params) -> dict:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, **params}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    yield call
    client.close()


def texts(reply: dict) -> list[str]:
    return [c["text"] for c in sorted(reply["choices"], key=lambda c: c["index"])]


@pytest.fixture(scope="module")
def greedy(complete) -> str:
    return texts(complete(temperature=0, ignore_eos=True))[0]


def test_temperature_0_is_greedy_and_other_routes_to_the_argmax_agree(complete, greedy):
    assert len(greedy) > 20
    # Only the argmax survives top_k=1, a tiny top_p, or min_p=1, at any temperature.
    for params in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        got = texts(complete(temperature=1.5, seed=3, ignore_eos=True, **params))[0]
        assert got == greedy, params
    # n greedy choices are all the one greedy text
    assert texts(complete(temperature=0, n=3, ignore_eos=True)) == [greedy] * 3


def test_a_seed_reproduces_a_sample_and_another_seed_changes_it(complete, greedy):
    a = texts(complete(temperature=1.0, seed=11, n=2, ignore_eos=True))
    b = texts(complete(temperature=1.0, seed=11, n=2, ignore_eos=True))
    c = texts(complete(temperature=1.0, seed=12, n=2, ignore_eos=True))
    assert a == b
    assert a != c
    assert a[0] != a[1], "the n choices of one seeded request are independent samples"
    assert greedy not in a + c, "temperature 1 sampled exactly the greedy text"


def test_a_stop_string_ends_the_text_before_it(complete, greedy):
    words = greedy.split()
    stop = " " + words[len(words) // 2]
    cut = greedy.index(stop)
    reply = complete(temperature=0, ignore_eos=True, stop=[stop])
    assert texts(reply) == [greedy[:cut]]
    assert reply["choices"][0]["finish_reason"] == "stop"
    kept = complete(temperature=0, ignore_eos=True, stop=[stop],
                    include_stop_str_in_output=True)
    assert texts(kept) == [greedy[:cut + len(stop)]]


def test_max_tokens_and_ignore_eos_fix_the_length_and_min_tokens_defers_eos(stack):
    def chat(**params) -> dict:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}],
                "temperature": 0, "max_tokens": 64, **params}
        r = httpx.post(stack.base_url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    short = chat()      # SmolLM2 answers briefly and ends with its end-of-turn token
    n = short["usage"]["completion_tokens"]
    assert short["choices"][0]["finish_reason"] == "stop" and n < 40, short
    at_least = chat(min_tokens=n + 10)
    assert at_least["usage"]["completion_tokens"] >= n + 10
    full = chat(ignore_eos=True)
    assert full["usage"]["completion_tokens"] == 64
    assert full["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 2.0}, {"frequency_penalty": 2.0},
                                     {"presence_penalty": 2.0}])
def test_penalties_reduce_repetition(complete, penalty):
    prompt = "one two one two one two one two one two"
    plain = complete(prompt=prompt, temperature=0, max_tokens=24, ignore_eos=True,
                     logprobs=0)
    penalized = complete(prompt=prompt, temperature=0, max_tokens=24, ignore_eos=True,
                         logprobs=0, **penalty)
    tokens = plain["choices"][0]["logprobs"]["tokens"]
    fewer = penalized["choices"][0]["logprobs"]["tokens"]
    assert len(set(fewer)) > len(set(tokens)), (tokens, fewer)


def test_beam_search_returns_n_distinct_beams_best_first(complete):
    reply = complete(use_beam_search=True, n=3, temperature=0, max_tokens=8, ignore_eos=True,
                     logprobs=0)
    beams = sorted(reply["choices"], key=lambda c: c["index"])
    assert len(beams) == 3
    assert len({b["text"] for b in beams}) == 3
    # Equal lengths (ignore_eos), so the score is the sum of the token logprobs.
    scores = [sum(b["logprobs"]["token_logprobs"]) for b in beams]
    assert scores == sorted(scores, reverse=True), scores
    assert all(len(b["logprobs"]["tokens"]) == 8 for b in beams)
    # The beams are the likeliest continuations found, not any three: the best one is at
    # least as likely as the greedy one (which a search of width 3 keeps in view here).
    greedy = complete(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    greedy_score = sum(greedy["choices"][0]["logprobs"]["token_logprobs"])
    assert scores[0] >= greedy_score - 1e-3, (scores, greedy_score)
