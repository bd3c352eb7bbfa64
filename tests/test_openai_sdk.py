"""The official `openai` SDK, unmodified, against the real stack (SmolLM2 on the CPU)."""
from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key or "none",
                         max_retries=0, timeout=120)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion_answers_with_usage(client):
    r = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0,
                                       messages=[{"role": "user", "content": "What is 2+2?"}])
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert "4" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the chat template wraps the question, so the prompt is longer than the words
    assert r.usage.prompt_tokens > 10


def test_chat_stream_equals_the_non_streamed_answer(client):
    msgs = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, max_tokens=20, temperature=0, messages=msgs)
    stream = client.chat.completions.create(model=MODEL, max_tokens=20, temperature=0,
                                            messages=msgs, stream=True,
                                            stream_options={"include_usage": True})
    text, usage, reasons = "", None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert text == whole.choices[0].message.content
    assert reasons == [whole.choices[0].finish_reason]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_completion_max_tokens_is_exact_with_length_finish(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7


def test_completion_stream_and_logprobs(client):
    stream = client.completions.create(model=MODEL, prompt="The capital of France is",
                                       max_tokens=8, temperature=0, logprobs=3, stream=True)
    tokens, text = [], ""
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            if c.logprobs and c.logprobs.tokens:
                tokens += c.logprobs.tokens
                for lp, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs):
                    assert lp <= 0
                    assert 1 <= len(top) <= 3
                    # greedy: the chosen token is the most likely one
                    assert lp == pytest.approx(max(top.values()), abs=1e-4)
    assert "".join(tokens) == text
    assert len(tokens) >= 1


def test_n_gives_distinct_samples_and_counts_usage(client):
    r = client.completions.create(model=MODEL, prompt="My favourite animal is", n=3,
                                  max_tokens=12, temperature=1.0, seed=5,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) >= 2
    assert r.usage.completion_tokens == 36


def test_same_seed_gives_same_sampled_text(client):
    kw = dict(model=MODEL, prompt="Write a word:", max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1


def test_stop_string_is_trimmed(client):
    base = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=16,
                                     temperature=0).choices[0].text
    assert len(base) > 4
    stop = base[2:4]          # a stop string from inside the greedy continuation
    r = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=16,
                                  temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[:base.index(stop)]


def test_unknown_model_is_a_404_with_an_error_body(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=1)
    assert "gpt-17" in str(err.value)


PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Roses are red,", "The sun rises in the"]


def test_several_prompts_with_n_give_prompt_major_choices_equal_to_single_answers(client):
    kw = dict(model=MODEL, max_tokens=6, temperature=0)
    singles = [client.completions.create(prompt=p, **kw) for p in PROMPTS]
    single = [r.choices[0].text for r in singles]
    assert len(set(single)) == len(PROMPTS)          # the order below is observable
    expected = [single[i // 2] for i in range(2 * len(PROMPTS))]   # prompt_index * n + j

    whole = client.completions.create(prompt=PROMPTS, n=2, **kw)
    assert [c.index for c in whole.choices] == list(range(8))
    assert [c.text for c in whole.choices] == expected
    assert whole.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in singles)
    assert whole.usage.completion_tokens == 2 * sum(r.usage.completion_tokens for r in singles)

    texts = [""] * 8
    usage = None
    for chunk in client.completions.create(prompt=PROMPTS, n=2, stream=True,
                                           stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == expected
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()


def test_logit_bias_bans_the_greedy_token_and_forces_another(client, stack):
    def tokens(text: str) -> list[int]:
        return httpx.post(stack.base_url + "/tokenize", json={
            "prompt": text, "add_special_tokens": False}).json()["tokens"]

    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0)
    greedy = client.completions.create(**kw).choices[0].text
    (greedy_id,) = tokens(greedy)
    banned = client.completions.create(logit_bias={str(greedy_id): -100}, **kw).choices[0]
    assert banned.text != greedy
    forced_id = tokens(" banana")[0]
    forced = client.completions.create(logit_bias={str(forced_id): 100},
                                       **dict(kw, max_tokens=3)).choices[0]
    assert forced.text == httpx.post(stack.base_url + "/detokenize",
                                     json={"tokens": [forced_id] * 3}).json()["prompt"]


def test_echo_with_max_tokens_zero_scores_the_prompt_only(client):
    kw = dict(model=MODEL, prompt="The cat sat on the mat", echo=True, logprobs=1,
              temperature=0)
    scored = client.completions.create(max_tokens=0, **kw)
    choice = scored.choices[0]
    assert choice.text == "The cat sat on the mat"
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == scored.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert scored.usage.completion_tokens == 0
    # the same prompt logprobs as with one generated token (lm-eval's max_tokens 1)
    one = client.completions.create(max_tokens=1, **kw).choices[0].logprobs
    assert one.token_logprobs[:len(lp.tokens)] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert len(one.tokens) == len(lp.tokens) + 1
