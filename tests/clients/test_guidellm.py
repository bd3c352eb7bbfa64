"""guidellm (the vLLM project's benchmark tool), unmodified, against `pagedserve serve`.

It sends what it sends to vLLM: streamed requests with `stream_options.include_usage` and
vLLM's `continuous_usage_stats`, `ignore_eos`, `max_completion_tokens` for chat. Each run
is synthetic data (16 prompt tokens, 8 output tokens), 40 requests at concurrency 8. Every
request guidellm sends must succeed, and the token counts guidellm reports for each request
must equal the usage pagedserve computed for it (read back from the request's output stream).

NOTE: guidellm leaves out of its report a request it cancelled before it counted it as
started (its accumulator ignores "cancelled before starting"); when its workers stop at the
`max_requests` count, one of the requests in flight can end that way, before it reached
the gateway or after (seen: 39 successful, none errored or incomplete, and the gateway
answered 39 in one run, 40 in another). So the gateway's own count of answered requests on
the endpoint may exceed guidellm's successful ones by the requests in flight at the stop,
never more, and never fall short of them.
"""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

REQUESTS, CONCURRENCY = 40, 8


def answered(base_url: str, endpoint: str) -> int:
    """How many requests on `endpoint` the gateway answered with 200 (its /metrics)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as r:
        text = r.read().decode()
    prefix = f'pagedserve:gateway_requests_total{{endpoint="{endpoint}",status="200"}} '
    return sum(int(float(line[len(prefix):])) for line in text.splitlines()
               if line.startswith(prefix))


def final_usage(base_url: str, response_id: str) -> dict:
    """The usage of a finished request, from a replay of its output stream."""
    with urllib.request.urlopen(f"{base_url}/v1/streams/{response_id}", timeout=30) as r:
        lines = r.read().decode().splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return chunks[-1]["usage"]


@pytest.mark.parametrize("request_format", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_runs_without_errors_and_counts_our_tokens(stack, hf_dir, offline_env, tmp_path,
                                                            request_format):
    out = tmp_path / "benchmarks.json"
    guidellm = Path(sys.executable).with_name("guidellm")
    cmd = [str(guidellm), "run",
           "--backend", f"kind=openai_http,target={stack.base_url},"
                        f"request_format={request_format}",
           "--profile", f"kind=concurrent,streams={CONCURRENCY}",
           "--constraint", f"kind=max_requests,count={REQUESTS}",
           "--tokenizer", f"kind=huggingface_auto,model={hf_dir}",
           "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
           "--output", f"kind=json,path={out}", "--disable-console"]
    before = answered(stack.base_url, request_format)
    run = subprocess.run(cmd, env=offline_env, capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    requests = json.loads(out.read_text())["benchmarks"][0]["requests"]
    assert (len(requests["errored"]), len(requests["incomplete"])) == (0, 0)
    sent = answered(stack.base_url, request_format) - before
    ok = len(requests["successful"])
    assert REQUESTS - CONCURRENCY < ok <= sent < ok + CONCURRENCY
    for req in requests["successful"]:
        usage = final_usage(stack.base_url, req["response_id"])
        assert req["input_metrics"]["text_tokens"] == usage["prompt_tokens"]
        assert req["output_metrics"]["text_tokens"] == usage["completion_tokens"] == 8
