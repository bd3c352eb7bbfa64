"""Requests through the real gateway and real Redis, with the test playing the scheduler."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shared.messages import RequestOutput, SeqDelta, TokenLogprob
from shared.wire import encode
from tests.gateway.conftest import sse_events

MODEL = "SmolLM2-135M-Instruct"
pool = ThreadPoolExecutor(20)


def start(http, path, body, **kw):
    """POST in the background (the answer needs the scheduler's outputs first)."""
    return pool.submit(http.post, path, json=body, **kw)


def ids_of(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def data_events(body: str) -> list[tuple[str | None, object]]:
    return [(i, d if d == "[DONE]" else json.loads(d)) for i, d in sse_events(body)]


def test_request_on_the_wire_carries_prompt_and_sampling_parameters(http, scheduler, tokenizer):
    fut = start(http, "/v1/completions", {
        "model": MODEL, "prompt": "Say hi", "max_tokens": 9, "n": 2, "best_of": 4,
        "use_beam_search": True, "seed": 7, "top_k": -1, "min_p": 0.1, "priority": 3,
        "stop_token_ids": [5], "temperature": 0.5, "repetition_penalty": 1.2, "min_tokens": 2})
    taken = scheduler.take()
    req, s = taken.request, taken.request.sampling
    assert req.prompt_token_ids == tokenizer.encode("Say hi")
    assert (s.n, s.beam_width, s.max_tokens, s.seed, s.top_k, s.min_p) == (2, 4, 9, 7, 0, 0.1)
    assert (s.temperature, s.repetition_penalty, s.min_tokens) == (0.5, 1.2, 2)
    assert s.stop_token_ids == [5, tokenizer.eos_token_id] and req.priority == 3
    assert req.arrival_time == pytest.approx(time.time(), abs=5)
    ttl = scheduler.r.ttl(scheduler.keys.output(req.request_id))
    assert 0 < ttl <= 600
    scheduler.emit(req.request_id, SeqDelta(0, [], finish_reason="length"),
                   SeqDelta(1, [], finish_reason="length"), finished=True)
    assert fut.result(10).status_code == 200


def test_ignore_eos_keeps_eos_out_of_the_stop_tokens(http, scheduler, tokenizer):
    fut = start(http, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "max_tokens": 3})
    req = scheduler.take().request
    assert tokenizer.eos_token_id not in req.sampling.stop_token_ids
    assert req.prompt_token_ids == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True,
        return_dict=False)
    scheduler.emit(req.request_id, SeqDelta(0, [], finish_reason="length"), finished=True)
    assert fut.result(10).json()["choices"][0]["message"] == {"role": "assistant", "content": ""}


def test_completion_joins_steps_and_reports_usage(http, scheduler, tokenizer):
    fut = start(http, "/v1/completions", {"prompt": "Say hi", "max_tokens": 5})
    rid = scheduler.take().request.request_id
    toks = ids_of(tokenizer, " Hello there, 世界")
    scheduler.emit(rid, SeqDelta(0, toks[:3]))
    scheduler.emit(rid, SeqDelta(0, toks[3:], finish_reason="length"), finished=True)
    r = fut.result(10)
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    body = r.json()
    assert body["id"] == rid and body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"][0]["text"] == " Hello there, 世界"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(tokenizer.encode("Say hi")),
                             "completion_tokens": len(toks),
                             "total_tokens": len(tokenizer.encode("Say hi")) + len(toks)}


def test_chat_stream_has_role_chunk_redis_ids_and_usage_last(http, scheduler, tokenizer):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 10}
    fut = start(http, "/v1/chat/completions", body)
    rid = scheduler.take().request.request_id
    toks = ids_of(tokenizer, "Bonjour 🎉 à tous")
    entry_ids = [scheduler.emit(rid, SeqDelta(0, [t])) for t in toks]
    entry_ids.append(scheduler.emit(rid, SeqDelta(0, [], finish_reason="stop", stop_token_id=2),
                                    finished=True))
    r = fut.result(10)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = data_events(r.text)
    assert events[0][1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [e for e in events[1:] if e[1] != "[DONE]" and e[1]["choices"]]
    assert "".join(c[1]["choices"][0]["delta"].get("content", "") for c in content) == \
        "Bonjour 🎉 à tous"
    assert {c[0] for c in content} <= set(entry_ids)          # ids are the Redis entry ids
    assert content[-1][0] == entry_ids[-1]
    assert content[-1][1]["choices"][0]["finish_reason"] == "stop"
    assert events[-2][0] is None and events[-2][1]["usage"]["completion_tokens"] == len(toks) + 1
    assert events[-1][1] == "[DONE]"
    # the emoji's byte tokens produced no event of their own: no half character was sent
    assert all("\ufffd" not in json.dumps(e[1], ensure_ascii=False) for e in events)


def test_stop_string_across_tokens_trims_text_and_aborts(http, scheduler, tokenizer):
    fut = start(http, "/v1/completions", {"prompt": "x", "max_tokens": 50, "stream": True,
                                          "stop": ["lazy dog"]})
    rid = scheduler.take().request.request_id
    for t in ids_of(tokenizer, "The quick brown fox jumps over the lazy dog and more"):
        scheduler.emit(rid, SeqDelta(0, [t]))
    events = data_events(fut.result(10).text)
    chunks = [e[1] for e in events if e[1] != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "The quick brown fox jumps over the "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == "lazy dog"
    scheduler.wait_abort(rid, timeout=2)


@pytest.mark.parametrize("stream", [True, False])
def test_a_choice_ending_at_a_stop_string_stops_only_its_sequence(http, scheduler, tokenizer,
                                                                  stream):
    fut = start(http, "/v1/completions", {"prompt": "x", "max_tokens": 50, "stream": stream,
                                          "n": 2, "stop": ["lazy dog"]})
    rid = scheduler.take().request.request_id
    for t in ids_of(tokenizer, "The quick brown fox jumps over the lazy dog"):
        scheduler.emit(rid, SeqDelta(0, [t]), SeqDelta(1, [t + 1]))
    deadline = time.monotonic() + 5
    while not any(a.request_id == rid for a in scheduler.aborts()):
        assert time.monotonic() < deadline, "choice 0 was not stopped in the scheduler"
        time.sleep(0.01)
    aborts = [a for a in scheduler.aborts() if a.request_id == rid]
    assert [(a.index, a.reason) for a in aborts] == [(0, "stop_string")]
    assert not fut.done()                  # choice 1 goes on
    scheduler.emit(rid, SeqDelta(1, ids_of(tokenizer, " end"), finish_reason="length"),
                   finished=True)
    body = fut.result(10).text
    if stream:
        chunks = [e[1] for e in data_events(body) if e[1] != "[DONE]"]
        text0 = "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == 0)
    else:
        text0 = json.loads(body)["choices"][0]["text"]
    assert text0 == "The quick brown fox jumps over the "
    time.sleep(0.2)
    assert len([a for a in scheduler.aborts() if a.request_id == rid]) == 1   # nothing more


def test_refusal_before_streaming_is_an_http_error(http, scheduler):
    for stream in (False, True):
        fut = start(http, "/v1/completions", {"prompt": "x", "stream": stream})
        rid = scheduler.take().request.request_id
        scheduler.emit(rid, finished=True, error="the prompt needs 900 blocks; the pool has 512",
                       error_code=400)
        r = fut.result(10)
        assert r.status_code == 400, r.text
        assert "900 blocks" in r.json()["error"]["message"]


def test_error_after_streaming_started_is_an_error_event(http, scheduler, tokenizer):
    fut = start(http, "/v1/completions", {"prompt": "x", "stream": True, "max_tokens": 9})
    rid = scheduler.take().request.request_id
    scheduler.emit(rid, SeqDelta(0, ids_of(tokenizer, "Hi")))
    time.sleep(0.2)
    scheduler.emit(rid, finished=True, error="executor lost", error_code=500)
    r = fut.result(10)
    assert r.status_code == 200
    events = data_events(r.text)
    assert events[-2][1]["error"]["message"] == "executor lost"
    assert events[-1][1] == "[DONE]"


def test_n_choices_with_logprobs_in_both_dialects(http, scheduler, tokenizer):
    a, b = ids_of(tokenizer, " yes"), ids_of(tokenizer, " no")
    lp = lambda t: TokenLogprob(t, -0.5, [[t, -0.5], [9, -1.5], [10, -2.5]])  # noqa: E731
    seqs = lambda: (SeqDelta(0, a, [lp(t) for t in a], finish_reason="length"),  # noqa: E731
                    SeqDelta(1, b, [lp(t) for t in b], finish_reason="length"))
    fut = start(http, "/v1/completions", {"prompt": "?", "n": 2, "logprobs": 2, "max_tokens": 1})
    scheduler.emit(scheduler.take().request.request_id, *seqs(), finished=True)
    body = fut.result(10).json()
    c0 = body["choices"][0]["logprobs"]
    assert c0["tokens"] == [tokenizer.decode([t]) for t in a]
    assert c0["token_logprobs"] == [-0.5] * len(a)
    assert len(c0["top_logprobs"][0]) == 2 and c0["text_offset"][0] == 0
    assert body["usage"]["completion_tokens"] == len(a) + len(b)

    fut = start(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "?"}],
                                               "n": 2, "logprobs": True, "top_logprobs": 3,
                                               "max_tokens": 1})
    scheduler.emit(scheduler.take().request.request_id, *seqs(), finished=True)
    body = fut.result(10).json()
    content = body["choices"][1]["logprobs"]["content"]
    assert [c["token"] for c in content] == [tokenizer.decode([t]) for t in b]
    assert bytes(content[0]["bytes"]).decode() == tokenizer.decode([b[0]])
    assert len(content[0]["top_logprobs"]) == 3
    assert body["choices"][1]["message"]["content"] == " no"


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_sends_an_abort_promptly(gateway, scheduler, tokenizer, stream):
    body = {"prompt": "tell me a long story", "max_tokens": 500, "stream": stream}
    seen_first = threading.Event()

    def client():
        with httpx.Client(base_url=gateway.url, timeout=2) as c:
            if not stream:
                with pytest.raises(httpx.ReadTimeout):
                    c.post("/v1/completions", json=body, timeout=0.5)
                return time.monotonic()
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        seen_first.set()
                        break
            return time.monotonic()       # the connection is closed here

    fut = pool.submit(client)
    rid = scheduler.take().request.request_id
    if stream:
        scheduler.emit(rid, SeqDelta(0, ids_of(tokenizer, "Once")))
        assert seen_first.wait(5)
    closed_at = fut.result(10)
    scheduler.wait_abort(rid, timeout=3)
    assert time.monotonic() - closed_at < 1.0    # the test's own polling included
    assert any(a.reason == "client_disconnected" for a in scheduler.aborts()
               if a.request_id == rid)


def test_resume_with_last_event_id_continues_with_identical_events(http, gateway, scheduler,
                                                                   tokenizer):
    body = {"prompt": "x", "stream": True, "n": 2, "stop": ["END"], "max_tokens": 30,
            "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=gateway.url, timeout=10) as first:
        with first.stream("POST", "/v1/completions", json=body) as live:
            rid = scheduler.take().request.request_id
            text = ids_of(tokenizer, "日本語 text, then the END of it")
            for t in text[:4]:
                scheduler.emit(rid, SeqDelta(0, [t]), SeqDelta(1, [t]))
            # a second client joins mid-stream from the start, and a third after event 2
            whole = pool.submit(http.get, f"/v1/streams/{rid}")
            time.sleep(0.3)
            partial_ids = [i for i, _ in data_events(_wait_events(http, rid))]
            after = partial_ids[1]
            time.sleep(0.1)
            # that resumed reader left, but the first connection still follows: no abort
            assert not [a for a in scheduler.aborts() if a.request_id == rid]
            rest = pool.submit(http.get, f"/v1/streams/{rid}", headers={"Last-Event-ID": after})
            for t in text[4:]:
                scheduler.emit(rid, SeqDelta(0, [t]), SeqDelta(1, [t]))
            scheduler.emit(rid, SeqDelta(1, [], finish_reason="length"), finished=True)
            original = data_events(live.read().decode())
    assert data_events(whole.result(10).text) == original
    k = [i for i, _ in original].index(after)
    assert data_events(rest.result(10).text) == original[k + 1:]
    texts = ["".join(e[1]["choices"][j]["text"] for e in original[:-2] if e[1]["choices"]
                     and len(e[1]["choices"]) > j) for j in (0, 1)]
    assert texts[0] == "日本語 text, then the "


def _wait_events(http, rid) -> str:
    """What a resuming client gets once the stream has at least two events (then it leaves)."""
    with http.stream("GET", f"/v1/streams/{rid}") as r:
        got = ""
        for line in r.iter_lines():
            got += line + "\n"
            if got.count("id: ") >= 2 and line == "":
                return got
    return got


def test_resuming_an_unknown_stream_is_404_and_a_bad_event_id_400(http):
    r = http.get("/v1/streams/cmpl-nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
    r = http.get("/v1/streams/cmpl-nope", headers={"Last-Event-ID": "yesterday"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"


def test_concurrent_streams_share_one_reader_without_cross_talk(http, scheduler, tokenizer):
    futs = [start(http, "/v1/completions", {"prompt": "x", "stream": True, "max_tokens": 20})
            for _ in range(16)]
    rids = [scheduler.take().request.request_id for _ in futs]
    words = {rid: ids_of(tokenizer, f" request {i} says hello") for i, rid in enumerate(rids)}
    for step in range(max(len(w) for w in words.values())):
        pipe = scheduler.r.pipeline()          # one scheduler step feeds every stream
        for rid, toks in words.items():
            if step < len(toks):
                last = step == len(toks) - 1
                pipe.xadd(scheduler.keys.output(rid), {b"m": encode(RequestOutput(
                    rid, [SeqDelta(0, [toks[step]], finish_reason="length" if last else None)],
                    finished=last))})
        pipe.execute()
    seen = set()
    for fut in futs:                          # (requests reach Redis in any order)
        r = fut.result(10)
        rid = r.headers["x-request-id"]
        text = "".join(e[1]["choices"][0]["text"] for e in data_events(r.text)
                       if e[1] != "[DONE]")
        assert text == tokenizer.decode(words[rid])
        seen.add(rid)
    assert seen == set(rids)
