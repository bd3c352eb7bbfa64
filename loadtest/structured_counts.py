"""Structured outputs and tool calls at full count, through the real stack and the `openai` SDK.

Starts `pagedserve serve` (its own Redis, executor, scheduler, gateway processes; SmolLM2 on
the CPU) three times: a normal KV pool, then a pool so small that requests are preempted,
by swap and then by recompute. Every check prints how many of its outputs passed:

    json          json_schema (nested object, array of enums, required), temperature 1.0
    json n=4      the same, n = 4 per request
    json stream   the same, streamed (chunks joined)
    swap / recompute    the same on the tiny pool; the run fails unless preemptions happened
                  (and blocks were swapped out exactly in the swap run)
    tools req / tools named    tool_choice "required" / a named function, temperature 1.0:
                  every call's arguments validate (jsonschema), finish_reason "tool_calls"
    tools stream  greedy, streamed with the SDK's stream helper and by accumulating deltas:
                  both assemble to the non-streamed call (name and arguments)
    multi-turn    call -> tool result -> answer through the SDK
    choice / regex    completions at temperature 1.0: the output is one of the choices /
                  matches the regex whole

    python loadtest/structured_counts.py                 # 50 / 20 per check, as in the docs
    python loadtest/structured_counts.py --requests 10 --tool-requests 5   # a quick look

Exits 1 unless every check passed in full.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jsonschema  # noqa: E402
import openai  # noqa: E402

from services.launcher import Stack, build_parser, free_port, free_ports  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
STR = {"type": "string", "maxLength": 16}
PROFILE = {"type": "object", "additionalProperties": False, "required": ["name", "age", "address",
                                                                        "tags", "status"],
           "properties": {
               "name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120},
               "address": {"type": "object", "additionalProperties": False,
                           "required": ["city", "zip"],
                           "properties": {"city": STR,
                                          "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
               "tags": {"type": "array", "minItems": 1, "maxItems": 3,
                        "items": {"enum": ["admin", "staff", "guest"]}},
               "status": {"enum": ["active", "suspended"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 24},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                   "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                  "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
CITIES = ["Rome", "Paris", "Oslo", "Lima", "Cairo", "Kyoto", "Quito", "Bern", "Dakar", "Hanoi"]
FORMAT = {"type": "json_schema",
          "json_schema": {"name": "profile", "schema": PROFILE, "strict": True}}


def stack_of(*extra: str) -> Stack:
    flags = ["serve", "--port", str(free_port()), "--grpc-port", str(free_port()),
             "--zmq-port", str(free_ports(2)), "--device", "cpu", "--dtype", "float32",
             "--max-model-len", "512", "--max-num-seqs", "256", "--log-level", "warning",
             *extra]
    return Stack(build_parser().parse_args(flags))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def _profile_ok(text: str, reason: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PROFILE)
    except (ValueError, jsonschema.ValidationError):
        return False
    return reason == "stop"


def json_outputs(c: openai.OpenAI, i: int, n: int = 1, stream: bool = False) -> list[bool]:
    kw = dict(model=MODEL, max_tokens=200, temperature=1.0, seed=1000 + i, n=n,
              response_format=FORMAT,
              messages=[{"role": "user", "content": f"A user profile for {CITIES[i % 10]}."}])
    if not stream:
        r = c.chat.completions.create(**kw)
        return [_profile_ok(ch.message.content, ch.finish_reason) for ch in r.choices]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
    return [_profile_ok(texts[k], reasons[k]) for k in sorted(texts)] or [False]


def _tool_kw(i: int, choice) -> dict:
    return dict(model=MODEL, tools=[WEATHER, ADD], tool_choice=choice, max_tokens=120,
                messages=[{"role": "user", "content": f"What is {i} + {2 * i + 1}? And the "
                           f"weather in {CITIES[i % 10]}?"}])


def _calls_ok(choice) -> bool:
    calls = choice.message.tool_calls or []
    try:
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False
    return bool(calls) and choice.finish_reason == "tool_calls" and all(
        call.id.startswith("call_") and call.type == "function" for call in calls)


def tool_calls(c: openai.OpenAI, i: int, choice) -> list[bool]:
    r = c.chat.completions.create(temperature=1.0, seed=2000 + i, **_tool_kw(i, choice))
    ok = _calls_ok(r.choices[0])
    if isinstance(choice, dict):
        ok = ok and [t.function.name for t in r.choices[0].message.tool_calls] == ["add"]
    return [ok]


def tool_stream(c: openai.OpenAI, i: int) -> list[bool]:
    """Greedy: the SDK's stream helper, hand-accumulated deltas and the whole response agree."""
    kw = _tool_kw(i, "required")
    whole = c.chat.completions.create(temperature=0, **kw).choices[0]
    want = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
    with c.beta.chat.completions.stream(temperature=0, **kw) as s:
        final = s.get_final_completion().choices[0]
    helper = [(t.function.name, t.function.arguments) for t in final.message.tool_calls or []]
    acc: dict[int, list[str]] = {}
    reason, pieces = None, 0
    for chunk in c.chat.completions.create(temperature=0, stream=True, **kw):
        for ch in chunk.choices:
            reason = ch.finish_reason or reason
            for d in ch.delta.tool_calls or []:
                entry = acc.setdefault(d.index, ["", ""])
                entry[0] += d.function.name or ""
                entry[1] += d.function.arguments or ""
                pieces += 1
    summed = [tuple(acc[k]) for k in sorted(acc)]
    # arguments arrive as the model writes them: more pieces than calls
    return [_calls_ok(whole) and helper == want and summed == want and reason == "tool_calls"
            and final.finish_reason == "tool_calls" and pieces > len(want)]


def multi_turn(c: openai.OpenAI, i: int) -> list[bool]:
    msgs = [{"role": "user", "content": f"What is the weather in {CITIES[i % 10]}?"}]
    first = c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER],
                                      tool_choice="required", max_tokens=60, temperature=0)
    if not _calls_ok(first.choices[0]):
        return [False]
    call = first.choices[0].message.tool_calls[0]
    msgs += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER],
                                       max_tokens=40, temperature=0).choices[0]
    return [bool(answer.message.content) and answer.finish_reason in ("stop", "length")]


CHOICES = ["yes", "no", "maybe"]
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"


def choice_out(c: openai.OpenAI, i: int) -> list[bool]:
    r = c.completions.create(model=MODEL, prompt=f"Is {CITIES[i % 10]} big? Answer:",
                             max_tokens=8, temperature=1.0, seed=3000 + i,
                             extra_body={"structured_outputs": {"choice": CHOICES}})
    return [r.choices[0].text in CHOICES and r.choices[0].finish_reason == "stop"]


def regex_out(c: openai.OpenAI, i: int) -> list[bool]:
    r = c.completions.create(model=MODEL, prompt=f"The office in {CITIES[i % 10]}: call",
                             max_tokens=20, temperature=1.0, seed=4000 + i,
                             extra_body={"guided_regex": PHONE})
    return [bool(re.fullmatch(PHONE, r.choices[0].text)) and r.choices[0].finish_reason == "stop"]


def check(name: str, fn, count: int, results: list) -> None:
    t = time.perf_counter()
    with ThreadPoolExecutor(count) as pool:
        oks = [ok for batch in pool.map(fn, range(count)) for ok in batch]
    passed = sum(oks)
    results.append((name, passed, len(oks)))
    print(f"{name:<16} {passed:>4} / {len(oks):<4} {100 * passed / len(oks):6.1f} %"
          f"   ({time.perf_counter() - t:.0f} s)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--tool-requests", type=int, default=20)
    ap.add_argument("--multi-turn", type=int, default=5)
    ap.add_argument("--tiny-pool-blocks", type=int, default=40,
                    help="KV blocks (16 tokens) of the preemption runs: one request fits")
    args = ap.parse_args()
    n, k = args.requests, args.tool_requests
    results: list = []
    print(f"{'check':<16} {'pass':>4}   {'of':<4} {'rate':>8}")
    with stack_of() as stack:
        c = client(stack.start())
        check("json", lambda i: json_outputs(c, i), n, results)
        check("json n=4", lambda i: json_outputs(c, i, n=4), n, results)
        check("json stream", lambda i: json_outputs(c, i, stream=True), n, results)
        check("tools req", lambda i: tool_calls(c, i, "required"), k, results)
        check("tools named", lambda i: tool_calls(
            c, i, {"type": "function", "function": {"name": "add"}}), k, results)
        check("tools stream", lambda i: tool_stream(c, i), k, results)
        check("multi-turn", lambda i: multi_turn(c, i), args.multi_turn, results)
        check("choice", lambda i: choice_out(c, i), n, results)
        check("regex", lambda i: regex_out(c, i), n, results)
    for mode in ("swap", "recompute"):
        with stack_of("--num-gpu-blocks", str(args.tiny_pool_blocks), "--preemption-mode",
                      mode, "--no-prefix-caching") as stack:
            url = stack.start()
            c = client(url)
            check(mode, lambda i: json_outputs(c, i), n, results)
            preempted = _metric(url, "vllm:num_preemptions")
            swapped = _metric(url, "pagedserve:swapped_out_blocks")
            print(f"{'':<16} preemptions: {preempted:.0f}, blocks swapped out: {swapped:.0f}")
            if preempted < 1 or (swapped > 0) != (mode == "swap"):
                results.append((f"{mode} preempted", 0, 1))
    failed = [r for r in results if r[1] != r[2]]
    print("all passed" if not failed else f"FAILED: {', '.join(r[0] for r in failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
