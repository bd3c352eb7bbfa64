"""Schemathesis against the gateway's own /openapi.json: no 5xx, and every error has the body.

What runs, and why this way:

- The real gateway app under uvicorn (in a thread, real HTTP on a free port) against a
  private real Redis. The schema is the one the server serves at /openapi.json, loaded over
  HTTP, so the document and the server are tested together.
- No engine: a stand-in scheduler thread plays the scheduler over the real wire (reads
  `GenerationRequest`s from the request stream with the consumer group, appends
  `RequestOutput`s, acknowledges, beats). It answers at once, so every valid generation —
  unary or streamed — completes in milliseconds and its 200 body is checked too, instead
  of hanging on a queue nobody reads. Its answers are shaped like the real scheduler's:
  the first token in one output and the rest with the finish reason in a second (streams
  get several events), per-token logprobs when asked, and a 400 refusal for a request
  that could never fit its (pretend) 512-slot KV pool. The tokens it returns are the last
  prompt tokens, so fuzzed token-id prompts (special tokens, partial UTF-8 byte tokens)
  go through the incremental detokenizer. The model itself is tested elsewhere
  (tests/test_stack.py); running it here would make 1,000 cases take minutes on a CPU.
- `max_model_len` is 256 so that schema-valid requests also reach the context-length
  rule (prompt + max_tokens), one of the cross-field checks a schema cannot state.

Each operation gets a budget of positive (schema-valid) and negative (schema-violating)
cases; the test asserts that the budget was really sent, so the sum (> 1,000) is a floor.
Checks on every response: schemathesis's `not_a_server_error`, `status_code_conformance`,
`content_type_conformance`, `response_schema_conformance`, and for negative cases
`negative_data_rejection` (anything the schema forbids is a 4xx); plus ours: every status
>= 400 has OpenAI's error body {"error": {"message": str, "type": str, ...}}. Positive
generation runs must also produce some 200s, so the test cannot pass by rejecting all.
`positive_data_acceptance` is not used: the cross-field rules above turn some schema-valid
requests into a 400 by design.

Hypothesis picks new inputs every run (a failure prints the seed to reproduce it with
`--hypothesis-seed`). About 30 s on two cores.
"""
from __future__ import annotations

import json
import math
import threading
from collections import Counter

import pytest
import redis
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from shared.messages import GenerationRequest, RequestOutput, SeqDelta, TokenLogprob
from tests.gateway.conftest import FakeScheduler

POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# (method, path, mode, cases). Operations without inputs have one possible case each.
BUDGET = [
    ("POST", "/v1/completions", POSITIVE, 250),
    ("POST", "/v1/completions", NEGATIVE, 100),
    ("POST", "/v1/chat/completions", POSITIVE, 250),
    ("POST", "/v1/chat/completions", NEGATIVE, 100),
    ("POST", "/tokenize", POSITIVE, 100),
    ("POST", "/tokenize", NEGATIVE, 60),
    ("POST", "/detokenize", POSITIVE, 80),
    ("POST", "/detokenize", NEGATIVE, 60),
    ("GET", "/v1/streams/{request_id}", POSITIVE, 60),
    ("GET", "/v1/streams/{request_id}", NEGATIVE, 60),
    ("GET", "/v1/models", POSITIVE, 1),
    ("GET", "/health", POSITIVE, 1),
    ("GET", "/ping", POSITIVE, 1),
    ("GET", "/metrics", POSITIVE, 1),
]
assert sum(b[3] for b in BUDGET) >= 1000
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
KV_SLOTS, BLOCK = 512, 16          # the stand-in's pretend KV pool (tokens) and block size
TIMEOUT_S = 10                     # per call; a generation answers in milliseconds


# ---------------------------------------------------------------- the stand-in scheduler

def answer(req: GenerationRequest) -> list[RequestOutput]:
    """What a real scheduler would append for req, without running a model."""
    s = req.sampling
    width = s.beam_width or s.n
    blocks = width * math.ceil((len(req.prompt_token_ids) + s.max_tokens) / BLOCK)
    if blocks * BLOCK > KV_SLOTS:
        return [RequestOutput(req.request_id, [], finished=True, error=(
            f"the request needs {blocks} KV blocks but the pool holds {KV_SLOTS // BLOCK}: "
            "shorten the prompt or lower max_tokens / n"), error_code=400)]
    k = min(3, s.max_tokens)
    tokens = (req.prompt_token_ids * 3)[-k:]
    stop = "stop" if k < s.max_tokens and s.stop_token_ids else "length"

    def delta(i: int, toks: list[int], last: bool) -> SeqDelta:
        lps = ([TokenLogprob(t, -0.5, [[t, -0.5]] * (s.logprobs or 0)) for t in toks]
               if s.logprobs is not None else [])
        return SeqDelta(i, toks, lps, finish_reason=stop if last else None,
                        stop_token_id=s.stop_token_ids[0] if last and stop == "stop" else None)

    n = s.n
    first = RequestOutput(req.request_id, [delta(i, tokens[:1], k == 1) for i in range(n)],
                          finished=k == 1, num_prompt_tokens=len(req.prompt_token_ids))
    if k == 1:
        return [first]
    return [first, RequestOutput(req.request_id, [delta(i, tokens[1:], True) for i in range(n)],
                                 finished=True)]


class StandInScheduler(threading.Thread):
    def __init__(self, url: str, prefix: str) -> None:
        super().__init__(daemon=True)
        self.fake = FakeScheduler(url, prefix)
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            self.fake.beat()
            try:
                taken = self.fake.take(timeout=0.2)
            except AssertionError:          # nothing queued in 0.2 s
                continue
            except redis.RedisError:
                return
            for out in answer(taken.request):
                self.fake.emit(out.request_id, *out.seqs, finished=out.finished,
                               num_prompt_tokens=out.num_prompt_tokens, error=out.error,
                               error_code=out.error_code)
            self.fake.ack(taken)

    def stop(self) -> None:
        self.stopping.set()
        self.join(5)


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def fuzzed(start_gateway, redis_proc):
    gw = start_gateway(max_model_len=256, read_block_ms=200, stream_start_wait_s=0.5)
    sched = StandInScheduler(redis_proc.url, gw.config.redis_prefix)
    sched.start()
    schema = schemathesis.openapi.from_url(gw.url + "/openapi.json")
    with requests.Session() as session:
        yield schema, session
    sched.stop()


def error_body_problem(response) -> str | None:
    """None when the response carries OpenAI's error body, else what is wrong with it."""
    content_type = ",".join(response.headers.get("content-type", []))   # lower-case keys
    if not content_type.startswith("application/json"):
        return f"content-type is {content_type!r}, not JSON"
    try:
        body = json.loads(response.content)
    except ValueError:
        return f"the body is not JSON: {response.content[:200]!r}"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return f"no 'error' object: {body!r:.200}"
    for key in ("message", "type"):
        if not isinstance(err.get(key), str) or not err[key]:
            return f"error.{key} is missing or not a non-empty string: {err!r:.200}"
    return None


# ---------------------------------------------------------------- the test

@pytest.mark.parametrize("method, path, mode, cases", BUDGET,
                         ids=[f"{m} {p} {g.value}" for m, p, g, _ in BUDGET])
def test_generated_requests_get_no_5xx_and_every_error_has_the_body(
        fuzzed, method, path, mode, cases):
    schema, session = fuzzed
    operation = schema[path][method]
    checks = CHECKS + ([negative_data_rejection] if mode is NEGATIVE else [])
    seen: Counter = Counter()      # status -> responses

    @settings(max_examples=cases, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        response = case.call(session=session, timeout=TIMEOUT_S)
        seen[response.status_code] += 1
        case.validate_response(response, checks=checks)
        if response.status_code >= 400:
            problem = error_body_problem(response)
            assert problem is None, (f"{case.method} {case.formatted_path} answered "
                                     f"{response.status_code} without the error body: {problem}"
                                     f"\n{case.as_curl_command()}")

    run()
    sent = sum(seen.values())
    assert sent >= cases, f"only {sent} of {cases} cases were sent: {dict(seen)}"
    assert not any(code >= 500 for code in seen)
    if mode is POSITIVE and path.endswith("completions"):
        # schema-valid generations must mostly be served, not all refused
        assert seen[200] >= cases // 4, f"too few 200s among valid requests: {dict(seen)}"
    if mode is NEGATIVE:
        assert not seen[200], f"a schema-invalid request was served: {dict(seen)}"
