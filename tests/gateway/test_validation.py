"""Every class of bad input is a 4xx with OpenAI's error body, and nothing reaches Redis."""
from __future__ import annotations

import json

import pytest

MODEL = "SmolLM2-135M-Instruct"
P = {"model": MODEL, "prompt": "hi", "max_tokens": 5}
C = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}

COMPLETION_CASES = [
    ("malformed json", b"{not json", 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("invalid utf-8", b'{"prompt": "\xff\xfe"}', 400, None),
    ("deep nesting", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("missing prompt", {"model": MODEL, "max_tokens": 5}, 400, "prompt"),
    ("wrong type", dict(P, max_tokens="five"), 400, "max_tokens"),
    ("bool for int", dict(P, n=True), 400, "n"),
    ("float for int", dict(P, max_tokens=5.0), 400, "max_tokens"),
    ("NaN temperature", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("negative max_tokens", dict(P, max_tokens=-3), 400, "max_tokens"),
    ("huge max_tokens", dict(P, max_tokens=10**9), 400, "max_tokens"),
    ("n over the limit", dict(P, n=10**4), 400, "n"),
    ("best_of below n", dict(P, n=3, best_of=2, use_beam_search=True), 400, "best_of"),
    ("best_of without beams", dict(P, n=1, best_of=3), 400, "best_of"),
    ("temperature out of range", dict(P, temperature=7), 400, "temperature"),
    ("top_p zero", dict(P, top_p=0), 400, "top_p"),
    ("logprobs over 20", dict(P, logprobs=21), 400, "logprobs"),
    ("too many stops", dict(P, stop=[str(i) for i in range(17)]), 400, "stop"),
    ("empty stop", dict(P, stop=[""]), 400, "stop"),
    ("stop not a string", dict(P, stop=[1]), 400, "stop[0]"),
    ("stop token out of vocab", dict(P, stop_token_ids=[10**6]), 400, "stop_token_ids"),
    ("prompt token out of vocab", dict(P, prompt=[1, -5]), 400, "prompt"),
    ("empty prompt", dict(P, prompt=""), 400, "prompt"),
    ("lone surrogate", b'{"prompt": "a\\ud800b", "max_tokens": 3}', 400, "prompt"),
    ("a prompt of a batch empty", dict(P, prompt=["a", ""]), 400, "prompt[1]"),
    ("a token prompt of a batch out of vocab", dict(P, prompt=[[1], [10**7]]), 400,
     "prompt[1]"),
    ("more prompts than allowed", dict(P, prompt=["a"] * 300), 400, "prompt"),
    ("prompt longer than the context", dict(P, prompt="hello " * 5000), 400, "prompt"),
    ("min_tokens above max_tokens", dict(P, min_tokens=9), 400, "min_tokens"),
    ("stream option of the wrong type", dict(P, stream=True,
                                             stream_options={"continuous_usage_stats": 1}),
     400, "stream_options.continuous_usage_stats"),
    ("echo not a boolean", dict(P, echo="yes"), 400, "echo"),
    ("user not a string", dict(P, user=5), 400, "user"),
    ("logit_bias over 100", dict(P, logit_bias={"5": 101}), 400, "logit_bias.5"),
    ("logit_bias NaN", b'{"prompt": "hi", "logit_bias": {"5": NaN}}', 400, "logit_bias.5"),
    ("logit_bias key not a token", dict(P, logit_bias={"dog": 1}), 400, "logit_bias"),
    ("logit_bias token out of vocab", dict(P, logit_bias={"10000000": 1}), 400, "logit_bias"),
    ("allowed_token_ids out of vocab", dict(P, allowed_token_ids=[10**7]), 400,
     "allowed_token_ids"),
    ("allowed_token_ids empty", dict(P, allowed_token_ids=[]), 400, "allowed_token_ids"),
    ("bad_words not strings", dict(P, bad_words=[3]), 400, "bad_words[0]"),
    ("truncate_prompt_tokens zero", dict(P, truncate_prompt_tokens=0), 400,
     "truncate_prompt_tokens"),
    ("prompt_logprobs with stream", dict(P, prompt_logprobs=1, stream=True), 400,
     "prompt_logprobs"),
    ("prompt_logprobs over 20", dict(P, prompt_logprobs=21), 400, "prompt_logprobs"),
    ("return_tokens_as_token_ids not a boolean", dict(P, return_tokens_as_token_ids=1), 400,
     "return_tokens_as_token_ids"),
    ("unknown model", dict(P, model="no-such-model"), 404, "model"),
]

CHAT_CASES = [
    ("missing messages", {"model": MODEL}, 400, "messages"),
    ("empty messages", dict(C, messages=[]), 400, "messages"),
    ("bad role", dict(C, messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    ("chat_template_kwargs not an object", dict(C, chat_template_kwargs=[1]), 400,
     "chat_template_kwargs"),
    ("continue_final_message after a user turn", dict(C, continue_final_message=True,
                                                      add_generation_prompt=False), 400,
     "continue_final_message"),
    ("continue_final_message with add_generation_prompt",
     dict(C, continue_final_message=True, add_generation_prompt=True), 400,
     "continue_final_message"),
    ("max_tokens zero", dict(C, max_tokens=0), 400, "max_tokens"),
    ("image part", dict(C, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, None),
    ("top_logprobs without logprobs", dict(C, top_logprobs=3), 400, "top_logprobs"),
    ("a function tool without its function", dict(C, tools=[{"type": "function"}]), 400, "tools[0].function"),
    ("max_completion_tokens too big", dict(C, max_completion_tokens=4000), 400,
     "max_completion_tokens"),
    ("max_tokens too big beside max_completion_tokens", dict(C, max_completion_tokens=4,
                                                             max_tokens=4000), 400, "max_tokens"),
    ("unknown model", dict(C, model="gpt-17"), 404, "model"),
]


def post(http, path, body):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={"content-type": "application/json"})


def assert_error(resp, status, param):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    assert "Traceback" not in resp.text


@pytest.fixture
def nothing_enqueued(gateway, redis_proc):
    r = redis_proc.client()
    prefix = gateway.config.redis_prefix
    before = set(r.keys(f"{prefix}:*"))
    yield
    assert set(r.keys(f"{prefix}:*")) == before, "a refused request left keys in Redis"


@pytest.mark.parametrize("name,body,status,param", COMPLETION_CASES,
                         ids=[c[0] for c in COMPLETION_CASES])
def test_bad_completion_is_refused_before_redis(http, nothing_enqueued, name, body, status, param):
    assert_error(post(http, "/v1/completions", body), status, param)


@pytest.mark.parametrize("name,body,status,param", CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_bad_chat_is_refused_before_redis(http, nothing_enqueued, name, body, status, param):
    assert_error(post(http, "/v1/chat/completions", body), status, param)


def test_prompt_too_long_names_both_lengths(http, tokenizer, nothing_enqueued):
    n = len(tokenizer.encode("hello " * 5000))
    err = post(http, "/v1/completions", dict(P, prompt="hello " * 5000)).json()["error"]
    assert f"{n} tokens" in err["message"] and "2048 tokens" in err["message"]
    assert err["code"] == "context_length_exceeded"


def test_context_length_error_is_worded_as_openai_words_it(http, tokenizer, nothing_enqueued):
    n = len(tokenizer.encode("hello " * 100))
    err = post(http, "/v1/completions", dict(P, prompt="hello " * 100, max_tokens=2000)
               ).json()["error"]
    assert err["message"].startswith(
        f"This model's maximum context length is 2048 tokens. However, you requested "
        f"{n + 2000} tokens ({n} in the prompt, 2000 for the completion).")
    assert err["param"] == "max_tokens"


def test_a_malformed_x_request_id_is_400(http, nothing_enqueued):
    r = http.post("/v1/completions", json=P, headers={"x-request-id": "a b/c"})
    assert_error(r, 400, "X-Request-Id")


def test_body_over_the_limit_is_413(start_gateway, redis_proc):
    gw = start_gateway(max_body_bytes=1000)
    import httpx
    r = httpx.post(gw.url + "/v1/completions", json=dict(P, prompt="x" * 2000))
    assert_error(r, 413, None)
    assert not redis_proc.client().keys(f"{gw.config.redis_prefix}:*")


def test_unknown_path_and_wrong_method_get_error_bodies(http):
    assert_error(http.get("/v1/nothing-here"), 404, None)
    assert_error(http.get("/v1/completions"), 405, None)


def test_unknown_model_card_is_404(http):
    assert_error(http.get("/v1/models/gpt-17"), 404, "model")
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
