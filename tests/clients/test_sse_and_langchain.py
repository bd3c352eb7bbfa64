"""Streams as line-based clients read them, resumable streams dropped and resumed, and
LangChain's OpenAI completions LLM batching prompts, all against `pagedserve serve`."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.clients.conftest import MODEL

BODY = {"model": MODEL, "prompt": "Once upon a time, in a small village,", "max_tokens": 24,
        "temperature": 0, "ignore_eos": True, "stream": True}


def data_lines(text: str) -> list[dict]:
    """What a line-based parser does: strip "data: " and parse, up to [DONE]."""
    out = []
    for line in text.split("\n"):
        if line.strip():
            assert line.startswith("data: "), f"not a data line: {line!r}"
            if line == "data: [DONE]":
                break
            out.append(json.loads(line[len("data: "):]))
    return out


def test_a_default_stream_is_only_data_lines(stack):
    r = httpx.post(stack.base_url + "/v1/completions", timeout=120,
                   json=dict(BODY, stream_options={"include_usage": True}))
    assert r.text.rstrip("\n").endswith("data: [DONE]")
    chunks = data_lines(r.text)
    assert chunks[-1]["usage"]["completion_tokens"] == 24


def test_a_dropped_resumable_stream_resumed_two_seconds_later_is_whole(stack):
    unbroken = "".join(c["choices"][0]["text"] for c in data_lines(httpx.post(
        stack.base_url + "/v1/completions", json=BODY, timeout=120).text) if c["choices"])
    seen, last_id = "", None
    with httpx.Client(timeout=120) as first:
        with first.stream("POST", stack.base_url + "/v1/completions", json=BODY,
                          headers={"X-Resumable-Stream": "true"}) as live:
            rid = live.headers["x-request-id"]
            events = 0
            for line in live.iter_lines():
                if line.startswith("id: "):
                    last_id = line[4:]
                elif line.startswith("data: "):
                    seen += json.loads(line[6:])["choices"][0]["text"]
                    events += 1
                    if events == 3:
                        break                  # drop the connection after a few tokens
    time.sleep(2.0)                            # the client is away for 2 s
    rest = httpx.get(f"{stack.base_url}/v1/streams/{rid}", headers={"Last-Event-ID": last_id},
                     timeout=120)
    assert rest.status_code == 200
    lines = [line for line in rest.text.split("\n") if line.startswith("data: {")]
    resumed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines
                      if json.loads(line[6:])["choices"])
    assert seen and resumed
    assert seen + resumed == unbroken


def test_langchain_openai_llm_batches_prompts(stack):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.OpenAI(model=MODEL, base_url=stack.base_url + "/v1",
                                  api_key="none", temperature=0, max_tokens=6, batch_size=3,
                                  max_retries=0)
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Roses are red,"]
    result = llm.generate(prompts)                 # one request with three prompts
    texts = [g[0].text for g in result.generations]
    alone = [llm.invoke(p) for p in prompts]
    assert texts == alone
    assert all(texts)
    usage = result.llm_output["token_usage"]
    assert usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 0
    assert llm.batch(prompts) == alone
