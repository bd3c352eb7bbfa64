"""The running system end to end: concurrency, disconnects and bad input through real processes."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from loadtest.serve_proc import service_pids
from services.engine import OfflineEngine
from services.executor.config import ExecutorConfig
from services.scheduler.config import SchedulerConfig
from shared.messages import SamplingParams
from shared.model_source import load_tokenizer, resolve_model

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "The quick brown fox", "In a galaxy far away", "Python is a language that",
    "The best way to cook rice is", "Dear diary, today", "Three facts about the moon:",
    "def fibonacci(n):", "The meaning of life is", "Once upon a time there was a",
    "Roses are red,", "To be or not to be", "The weather today is",
    "My favourite book is", "A good programmer always", "The history of Rome",
    "How do airplanes fly?",
]
NEW_TOKENS = 12


def _offline_reference(prompt_ids: list[list[int]]):
    engine = OfflineEngine(ExecutorConfig(device="cpu", dtype="float32", kv_cache_gib=0.25),
                           SchedulerConfig())
    reqs = [engine.request(ids, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=2),
                           request_id=f"ref{i}") for i, ids in enumerate(prompt_ids)]
    # logprobs come back through the scheduler's outputs; collect them per request
    tops: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.scheduler.add_request(r)
    tokens = {r.request_id: [] for r in reqs}
    while engine.scheduler.has_unfinished():
        plan = engine.scheduler.schedule()
        result = engine.runner.execute(plan)
        for out in engine.scheduler.update(plan, result).request_outputs():
            for d in out.seqs:
                tokens[out.request_id] += d.token_ids
                tops[out.request_id] += [lp.top for lp in d.logprobs]
    return [tokens[r.request_id] for r in reqs], [tops[r.request_id] for r in reqs]


async def _stream_completion(client: httpx.AsyncClient, prompt_ids: list[int]) -> str:
    body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": NEW_TOKENS, "temperature": 0,
            "stream": True}
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text += "".join(c["text"] for c in event["choices"])
    return text


def test_64_concurrent_streams_match_the_offline_engine(stack):
    tok = load_tokenizer(resolve_model(MODEL))
    prompt_ids = [tok.encode(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)))
                  for i in range(64)]

    async def run_all():
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
            return await asyncio.gather(*[_stream_completion(client, p) for p in prompt_ids])

    assert_offline_text(asyncio.run(run_all()), prompt_ids, tok)


def assert_offline_text(streamed: list[str], prompt_ids: list[list[int]], tok) -> None:
    """Each streamed text is the offline engine's greedy text for its prompt."""
    ref_tokens, ref_tops = _offline_reference(prompt_ids)
    near_ties = 0
    for i, (text, ids, tops) in enumerate(zip(streamed, ref_tokens, ref_tops)):
        expected = tok.decode(ids, skip_special_tokens=True)
        if text == expected:
            continue
        # Accepted only where the reference's top-2 logprobs were nearly tied (a batch of
        # another shape may flip that argmax); find the first differing token and check.
        k = next(j for j in range(len(ids) + 1)
                 if not text.startswith(tok.decode(ids[:j + 1], skip_special_tokens=True)))
        gap = abs(tops[k][0][1] - tops[k][1][1])
        assert gap < 1e-4, f"request {i} diverged at token {k} with top-2 gap {gap}"
        near_ties += 1
    assert near_ties <= 2


def test_disconnect_mid_stream_frees_blocks_within_a_few_steps(stack):
    body = {"model": MODEL, "prompt": "Tell me a very long story about dragons.",
            "max_tokens": 1000, "temperature": 0.8, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=stack.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            arrivals = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
                if len(arrivals) >= 6:
                    break
            # the gauges are a snapshot published every 0.2 s: six tokens can come sooner
            deadline = time.monotonic() + 10
            while stack.metric("pagedserve:gpu_blocks_used") == 0:
                assert time.monotonic() < deadline, "the running request holds no blocks"
                time.sleep(0.05)
        # leaving the `with` closes the connection mid-stream
    closed = time.monotonic()
    # The gateway sends the abort at once; the scheduler applies it before its next step
    # and publishes its gauges every 0.2 s. Bound: a few steps as measured on this run
    # (the machine may be shared), plus ten publishing periods for delivery on a loaded
    # machine; a request left running would hold its blocks for its ~990 remaining steps.
    step = max(b - a for a, b in zip(arrivals[1:], arrivals[2:]))
    bound = 2.0 + 5 * step
    while time.monotonic() - closed < bound:
        if (stack.metric("pagedserve:gpu_blocks_used") == 0
                and stack.metric("vllm:num_requests_running") == 0):
            break
        time.sleep(0.05)
    assert stack.metric("pagedserve:gpu_blocks_used") == 0, \
        f"blocks still held {bound:.2f} s after the disconnect (step {step:.3f} s)"
    assert stack.metric("vllm:num_requests_running") == 0


# The vLLM metric families the README promises on /metrics (the gateway merges every
# scheduler's exposition into its own).
VLLM_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds")
VLLM_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:num_requests_swapped", "vllm:kv_cache_usage_perc")


def test_vllm_metrics_count_a_real_request(stack):
    before = {f"{h}_count": stack.metric(f"{h}_count") for h in VLLM_HISTOGRAMS}
    before.update({c: stack.metric(c) for c in VLLM_COUNTERS + ("vllm:num_preemptions_total",)})
    for gauge in VLLM_GAUGES:
        stack.metric(gauge)      # present (KeyError otherwise)
    tokens = 40
    body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    usage_seen = False
    with httpx.Client(base_url=stack.base_url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not usage_seen and line.startswith("data: {"):
                    # while the request runs, its blocks show in the KV usage gauge
                    usage_seen = stack.metric("vllm:kv_cache_usage_perc") > 0
    assert usage_seen, "vllm:kv_cache_usage_perc stayed 0 while a request held KV blocks"
    _settled(stack, "vllm:generation_tokens_total")
    after = {name: stack.metric(name) for name in before}
    for h in VLLM_HISTOGRAMS:
        assert after[f"{h}_count"] > before[f"{h}_count"], h
    assert after["vllm:inter_token_latency_seconds_count"] - before[
        "vllm:inter_token_latency_seconds_count"] >= tokens - 1
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == tokens
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] >= 7
    assert stack.metric("vllm:e2e_request_latency_seconds_sum") > 0
    assert stack.metric("vllm:num_requests_running") == 0


BAD_BODIES = [
    ("malformed json", b"{not json", 400),
    ("missing prompt", {"model": MODEL, "max_tokens": 5}, 400),
    ("logit_bias out of range", {"model": MODEL, "prompt": "hi", "max_tokens": 5,
                                 "logit_bias": {"5": 500}}, 400),
    ("wrong type", {"model": MODEL, "prompt": "hi", "max_tokens": "five"}, 400),
    ("negative max_tokens", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400),
    ("huge max_tokens", {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, 400),
    ("n over the limit", {"model": MODEL, "prompt": "hi", "max_tokens": 5, "n": 10**4}, 400),
    ("prompt longer than the context", {"model": MODEL, "prompt": "hello " * 5000,
                                        "max_tokens": 5}, 400),
    ("unknown model", {"model": "no-such-model", "prompt": "hi", "max_tokens": 5}, 404),
]


@pytest.mark.parametrize("name,body,status", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_input_is_refused_and_never_reaches_the_scheduler(stack, name, body, status):
    import redis
    from shared.redis_keys import RedisKeys

    r = redis.Redis.from_url(stack.redis_url)
    keys = RedisKeys(f"t{stack.ports['http']}")
    # entries-added counts every request ever queued (finished ones are deleted)
    added = lambda: r.xinfo_stream(keys.requests)["entries-added"] if r.exists(  # noqa: E731
        keys.requests) else 0
    before = added()
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(stack.base_url + "/v1/completions", content=content,
                      headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert err["message"] and err["type"]
    assert "Traceback" not in resp.text
    assert added() == before


def test_a_choice_ending_at_a_stop_string_stops_generating_while_the_other_goes_on(stack):
    # First the same seeded request without a stop string, to see what each choice writes;
    # then a stop string that only choice 0 meets, early.
    body = {"model": MODEL, "prompt": "List some animals:", "max_tokens": 120, "n": 2,
            "temperature": 1.0, "seed": 7, "ignore_eos": True}
    with httpx.Client(base_url=stack.base_url, timeout=120) as client:
        free = client.post("/v1/completions", json=body).json()["choices"]
        text0, text1 = free[0]["text"], free[1]["text"]
        stop = next(text0[i:i + 6] for i in range(3, len(text0) - 6)
                    if text0[i:i + 6].strip() and text0[i:i + 6] not in text1)
        cut = text0.index(stop)
        assert cut < len(text0) // 2, "the seeded text gives no early stop string for choice 0"
        before = _settled(stack, "vllm:generation_tokens_total")
        got = client.post("/v1/completions", json={**body, "stop": [stop]}).json()
        generated = _settled(stack, "vllm:generation_tokens_total") - before
    choices = sorted(got["choices"], key=lambda c: c["index"])
    assert choices[0]["text"] == text0[:cut] and choices[0]["finish_reason"] == "stop"
    assert choices[1]["text"] == text1 and choices[1]["finish_reason"] == "length"
    # Choice 0's sequence stopped in the scheduler soon after its stop string (a few steps
    # of lag), instead of running to max_tokens: fewer than 2 x 120 tokens were generated.
    shown0 = got["usage"]["completion_tokens"] - 120
    assert generated < 120 + shown0 + 20, (generated, shown0)


def _settled(stack, name: str) -> float:
    """A scheduler counter once it has stopped moving (it is published every 0.2 s)."""
    value = stack.metric(name)
    for _ in range(50):
        time.sleep(0.3)
        now = stack.metric(name)
        if now == value:
            return now
        value = now
    return value


def _service_pid(stack, service: str) -> int:
    """The pid of `service` ("gateway", ...) of this stack (its command line names the
    stack's HTTP port)."""
    port = str(stack.ports["http"])
    for pid, argv in service_pids().get(service, []):
        if port in argv:
            return pid
    raise AssertionError(f"no {service} process of the stack on port {port}")


def test_the_gateway_process_never_loads_torch(stack):
    # (the wall: the gateway serves from its tokenizer and Redis; torch there would only add
    # start-up seconds and a few hundred MiB per gateway process)
    pid = _service_pid(stack, "gateway")
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read()
    assert "libtorch" not in maps and "libc10" not in maps
