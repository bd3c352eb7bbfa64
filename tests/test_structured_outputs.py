"""Structured outputs and tool calls through the real stack (SmolLM2 on the CPU) with the
unmodified `openai` SDK: every constrained output parses and validates, greedy and sampled,
n > 1 and streamed; required and named tool calls always carry valid arguments."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pydantic
import pytest

MODEL = "SmolLM2-135M-Instruct"

PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "address": {"type": "object", "additionalProperties": False,
                                     "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "zip": {"type": "string",
                                                            "pattern": "^[0-9]{5}$"}},
                                     "required": ["city", "zip"]}},
          "required": ["name", "age", "address"]}
ORDER = {"type": "object", "additionalProperties": False,
         "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"enum": ["apple", "bread", "milk"]}},
                        "express": {"type": "boolean"}},
         "required": ["items", "express"]}
SCHEMAS = {"person": PERSON, "order": ORDER}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 24},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
PARAMS = {"get_weather": WEATHER["function"]["parameters"], "add": ADD["function"]["parameters"]}


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key or "none",
                         max_retries=0, timeout=300)


def _format(name: str) -> dict:
    return {"type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def _ask(client, name: str, stream: bool, **kw) -> list[tuple[str, str]]:
    """(text, finish_reason) of every choice."""
    msgs = [{"role": "user", "content": f"Give me an example {name} as JSON."}]
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=160,
                                           response_format=_format(name), **kw)
        return [(c.message.content, c.finish_reason) for c in r.choices]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=160,
                                                response_format=_format(name), stream=True,
                                                **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return [(texts[i], reasons[i]) for i in sorted(texts)]


def test_json_schema_outputs_parse_and_validate(client):
    cases = [(name, stream, kw) for name in SCHEMAS for stream, kw in (
        (False, dict(temperature=0)),
        (False, dict(temperature=1.0, n=2, seed=11)),
        (True, dict(temperature=1.0, n=2, seed=12)))]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda c: (c[0], _ask(client, *c[:2], **c[2])), cases))
    count = 0
    for name, choices in results:
        for text, reason in choices:
            assert reason == "stop", (name, text)
            jsonschema.validate(json.loads(text), SCHEMAS[name])
            count += 1
    assert count == 2 * (1 + 2 + 2)


def test_json_object_mode_returns_an_object(client):
    r = client.chat.completions.create(
        model=MODEL, max_tokens=120, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat in JSON."}])
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:    # cut by max_tokens: still an object's prefix
        assert text.lstrip().startswith("{")


def test_regex_and_choice_hold_for_sampled_completions(client):
    phone = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, n=4,
                                      temperature=1.0, seed=3,
                                      extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    yn = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", n=4,
                                   max_tokens=8, temperature=1.0, seed=4,
                                   extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    for c in phone.choices:
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", c.text) and c.finish_reason == "stop"
    for c in yn.choices:
        assert c.text in ("yes", "no") and c.finish_reason == "stop"


def test_sdk_parse_with_a_pydantic_model(client):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)
        population: int = pydantic.Field(ge=0, le=100_000_000)   # bounded digits

    r = client.beta.chat.completions.parse(
        model=MODEL, max_tokens=100, temperature=0, response_format=City,
        messages=[{"role": "user", "content": "Tell me about Paris as JSON."}])
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def _streamed_calls(client, **kw) -> tuple[list[dict], str, int]:
    """The calls assembled from the deltas, the finish reason, and how many deltas came."""
    calls: dict[int, dict] = {}
    reason = None
    pieces = 0
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for c in chunk.choices:
            reason = c.finish_reason or reason
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:         # the first delta names the call
                    assert tc.id and tc.type == "function" and tc.function.name
                entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += tc.id or ""
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
                pieces += 1
    return [calls[i] for i in sorted(calls)], reason, pieces


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_required_and_named_tool_calls_validate_streamed_and_not(client, choice):
    kw = dict(messages=[{"role": "user", "content": "What is 2 + 40? And the weather in Rome?"}],
              tools=[WEATHER, ADD], tool_choice=choice, max_tokens=100, temperature=0)
    r = client.chat.completions.create(model=MODEL, **kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    if isinstance(choice, dict):
        assert [call.function.name for call in c.message.tool_calls] == ["add"]
    want = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    streamed, reason, pieces = _streamed_calls(client, **kw)
    assert reason == "tool_calls"
    assert [(s["name"], s["arguments"]) for s in streamed] == want
    assert all(s["id"].startswith("call_") for s in streamed)
    assert pieces > 2 * len(want)        # the arguments stream as the model writes them
    with client.beta.chat.completions.stream(model=MODEL, **kw) as s:    # the SDK's helper
        final = s.get_final_completion().choices[0]
    assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls] == want
    # sampled: the grammar still holds
    sampled = client.chat.completions.create(model=MODEL, n=3, seed=5,
                                             **dict(kw, temperature=1.0))
    for c in sampled.choices:
        assert c.finish_reason == "tool_calls"
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_a_tool_result_conversation_through_the_sdk(client):
    msgs = [{"role": "user", "content": "What is the weather in Rome?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="required", max_tokens=60,
        temperature=0)
    call = first.choices[0].message.tool_calls[0]
    msgs += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER],
                                            max_tokens=40, temperature=0)
    c = answer.choices[0]
    assert c.message.content and not c.message.tool_calls
    assert c.finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "wat"}}}}, "response_format.json_schema.schema"),
    # a json_schema object is checked whatever the type (schemathesis found one accepted)
    ({"response_format": {"type": "text", "json_schema": {"schema": {}, "strict": 1.5}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
])
def test_bad_constraints_are_refused_with_a_400(stack, body, param):
    r = httpx.post(stack.base_url + "/v1/chat/completions", timeout=30, json=dict(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], **body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
