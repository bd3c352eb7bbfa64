"""Async scheduling through `pagedserve serve --async-scheduling on` (the default on a GPU;
a CPU executor needs it asked for): 64 concurrent greedy streams get the offline engine's
text, most steps are planned ahead, and a client that disconnects while a step planned
ahead is in flight still frees its blocks."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from shared.model_source import load_tokenizer, resolve_model
from tests.conftest import metric_value, stop_process
from tests.serve_stack import Serve
from tests.test_stack import MODEL, PROMPTS, _stream_completion, assert_offline_text


@pytest.fixture(scope="module")
def serve():
    s = Serve("--async-scheduling", "on").wait_healthy()
    yield s
    stop_process(s.proc, timeout=20)


def _metric(s: Serve, name: str) -> float:
    return metric_value(httpx.get(s.base_url + "/metrics", timeout=10).text, name)


def _steps(s: Serve) -> tuple[float, float]:
    time.sleep(0.5)                          # the scheduler publishes its figures every 0.2 s
    return (_metric(s, "pagedserve:steps_total"),
            _metric(s, "pagedserve:steps_planned_ahead_total"))


def test_streams_planned_ahead_get_the_offline_engines_text(serve):
    tok = load_tokenizer(resolve_model(MODEL))
    prompt_ids = [tok.encode(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)))
                  for i in range(64)]
    steps0, ahead0 = _steps(serve)

    async def run_all():
        async with httpx.AsyncClient(base_url=serve.base_url, timeout=300) as client:
            return await asyncio.gather(*[_stream_completion(client, p) for p in prompt_ids])

    streamed = asyncio.run(run_all())
    steps1, ahead1 = _steps(serve)
    # 64 prompts prefill in a few steps, then 11 more tokens each: most steps run only
    # steady decodes, and every one of those is planned ahead
    assert ahead1 - ahead0 >= 0.5 * (steps1 - steps0), (steps1 - steps0, ahead1 - ahead0)
    assert_offline_text(streamed, prompt_ids, tok)


def test_a_disconnect_while_steps_are_planned_ahead_frees_the_blocks(serve):
    body = {"model": MODEL, "prompt": "Tell me a very long story about dragons.",
            "max_tokens": 1000, "temperature": 0.8, "ignore_eos": True, "stream": True}
    steps0, ahead0 = _steps(serve)
    with httpx.Client(base_url=serve.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():       # (leaving this loop closes the stream)
                events += line.startswith("data: ")
                if events == 20:
                    steps1, ahead1 = _steps(serve)
                    assert ahead1 - ahead0 >= 10, "a steady stream: steps planned ahead"
                    assert _metric(serve, "pagedserve:gpu_blocks_used") > 0
                if events >= 25:
                    break
    closed = time.monotonic()
    while time.monotonic() - closed < 10:
        if (_metric(serve, "pagedserve:gpu_blocks_used") == 0
                and _metric(serve, "vllm:num_requests_running") == 0):
            break
        time.sleep(0.1)
    assert _metric(serve, "pagedserve:gpu_blocks_used") == 0
    assert _metric(serve, "vllm:num_requests_running") == 0
    # and the stack goes on serving
    r = httpx.post(serve.base_url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
