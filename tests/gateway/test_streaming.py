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
from tests.gateway.conftest import FakeScheduler, sse_events

MODEL = "SmolLM2-135M-Instruct"
RESUMABLE = {"X-Resumable-Stream": "true"}
pool = ThreadPoolExecutor(20)


def until(condition, what: str, timeout: float = 5.0):
    """Poll condition() until it is truthy (and return it); fail after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


def readers(scheduler, rid) -> int:
    return int(scheduler.r.get(scheduler.keys.output(rid) + ":readers") or 0)


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


def test_resumable_chat_stream_has_role_chunk_redis_ids_and_usage_last(http, scheduler,
                                                                       tokenizer):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 10}
    fut = start(http, "/v1/chat/completions", body, headers=RESUMABLE)
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
    # the gateway sends its aborts before the response ends: none came after the first
    assert len([a for a in scheduler.aborts() if a.request_id == rid]) == 1


def test_refusal_before_streaming_is_an_http_error(http, scheduler):
    for stream in (False, True):
        fut = start(http, "/v1/completions", {"prompt": "x", "stream": stream})
        rid = scheduler.take().request.request_id
        scheduler.emit(rid, finished=True, error="the prompt needs 900 blocks; the pool has 512",
                       error_code=400)
        r = fut.result(10)
        assert r.status_code == 400, r.text
        assert "900 blocks" in r.json()["error"]["message"]


def test_error_after_streaming_started_is_an_error_event(gateway, scheduler, tokenizer):
    started = threading.Event()

    def client():
        with httpx.Client(base_url=gateway.url, timeout=10) as c:
            with c.stream("POST", "/v1/completions",
                          json={"prompt": "x", "stream": True, "max_tokens": 9}) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()           # the status line and a first event are out
                return r.status_code, "\n".join(lines) + "\n"

    fut = pool.submit(client)
    rid = scheduler.take().request.request_id
    scheduler.emit(rid, SeqDelta(0, ids_of(tokenizer, "Hi")))
    assert started.wait(5)
    scheduler.emit(rid, finished=True, error="executor lost", error_code=500)
    status, text = fut.result(10)
    assert status == 200
    events = data_events(text)
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
    # Prompt means on the disconnect itself: no further output ever comes for this request,
    # so a gateway that noticed the drop only when writing would never abort it. The bound
    # leaves a loaded machine seconds, and is still a third of the keep-alive interval.
    bound = gateway.config.keepalive_s / 3
    scheduler.wait_abort(rid, timeout=bound)
    assert time.monotonic() - closed_at < bound
    assert any(a.reason == "client_disconnected" for a in scheduler.aborts()
               if a.request_id == rid)


def test_resumed_readers_beside_the_live_connection_get_identical_events(
        http, gateway, scheduler, tokenizer):
    body = {"prompt": "x", "stream": True, "n": 2, "stop": ["END"], "max_tokens": 30,
            "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=gateway.url, timeout=10, headers=RESUMABLE) as first:
        with first.stream("POST", "/v1/completions", json=body) as live:
            rid = scheduler.take().request.request_id
            a, b = two_choices(tokenizer)
            emit_steps(scheduler, rid, a, b, 0, 4)
            # a second client joins mid-stream from the start, and a third after event 2
            whole = pool.submit(http.get, f"/v1/streams/{rid}")
            until(lambda: readers(scheduler, rid) == 2, "the replaying reader to attach")
            partial_ids = [i for i, _ in data_events(_wait_events(http, rid))]
            after = partial_ids[1]
            until(lambda: readers(scheduler, rid) == 2, "the third reader to leave")
            # that resumed reader left, but the first connection still follows: no abort
            assert not [a for a in scheduler.aborts() if a.request_id == rid]
            rest = pool.submit(http.get, f"/v1/streams/{rid}", headers={"Last-Event-ID": after})
            until(lambda: readers(scheduler, rid) == 3, "the resuming reader to attach")
            emit_steps(scheduler, rid, a, b, 4, len(b))
            scheduler.emit(rid, SeqDelta(1, [], finish_reason="length"), finished=True)
            original = data_events(live.read().decode())
    assert data_events(whole.result(10).text) == original
    k = [i for i, _ in original].index(after)
    assert data_events(rest.result(10).text) == original[k + 1:]
    assert _choice_texts(original) == ["日本語 text, then the ", "日本語 text, then the end of it"]


def two_choices(tokenizer) -> tuple[list[int], list[int]]:
    """Tokens of two choices: the first meets the stop string END, the second never does."""
    return (ids_of(tokenizer, "日本語 text, then the END of it"),
            ids_of(tokenizer, "日本語 text, then the end of it"))


def emit_steps(scheduler, rid, a, b, lo, hi) -> None:
    for k in range(lo, hi):
        scheduler.emit(rid, *[SeqDelta(j, [toks[k]]) for j, toks in enumerate((a, b))
                              if k < len(toks)])


def _choice_texts(events) -> list[str]:
    texts = ["", ""]
    for _id, e in events:
        if e != "[DONE]":
            for c in e["choices"]:
                texts[c["index"]] += c["text"]
    return texts


def test_a_dropped_resumable_stream_keeps_running_and_resumes_where_it_left(
        gateway, scheduler, tokenizer):
    body = {"prompt": "x", "stream": True, "n": 2, "stop": ["END"], "max_tokens": 30}
    a, b = two_choices(tokenizer)
    with httpx.Client(base_url=gateway.url, timeout=10, headers=RESUMABLE) as first:
        with first.stream("POST", "/v1/completions", json=body) as live:
            assert live.headers["x-resumable-stream"] == "true"
            rid = scheduler.take().request.request_id
            emit_steps(scheduler, rid, a, b, 0, 4)
            seen = ""
            for line in live.iter_lines():
                seen += line + "\n"
                if seen.count("id: ") >= 2 and line == "":
                    break
    # the client dropped: the gateway lets go of it but the request is not aborted
    until(lambda: readers(scheduler, rid) == 0, "the dropped connection to detach")
    before = data_events(seen)
    emit_steps(scheduler, rid, a, b, 4, len(b))
    scheduler.emit(rid, SeqDelta(1, [], finish_reason="length"), finished=True)
    with httpx.Client(base_url=gateway.url, timeout=10) as again:
        rest = data_events(again.get(f"/v1/streams/{rid}",
                                     headers={"Last-Event-ID": before[-1][0]}).text)
        whole = data_events(again.get(f"/v1/streams/{rid}").text)
    # the request as a whole was never aborted (choice 0 may be, at its stop string)
    assert all(x.index == 0 for x in scheduler.aborts() if x.request_id == rid)
    assert before + rest == whole
    assert _choice_texts(whole) == ["日本語 text, then the ", "日本語 text, then the end of it"]


def test_a_dropped_plain_stream_is_aborted_at_once_even_with_a_grace_period(
        gateway, scheduler, tokenizer):
    assert gateway.config.resume_grace_s >= 10
    with httpx.Client(base_url=gateway.url, timeout=10) as c:
        with c.stream("POST", "/v1/completions",
                      json={"prompt": "x", "stream": True, "max_tokens": 30}) as live:
            rid = scheduler.take().request.request_id
            scheduler.emit(rid, SeqDelta(0, ids_of(tokenizer, "Once")))
            next(line for line in live.iter_lines() if line.startswith("data: "))
        closed_at = time.monotonic()
    # at once: well inside the grace period a resumable stream would get
    bound = gateway.config.resume_grace_s / 4
    scheduler.wait_abort(rid, timeout=bound)
    assert time.monotonic() - closed_at < bound


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
    # 16 streams waiting, one blocked XREAD among them (the scheduler stand-in reads nothing)
    until(lambda: scheduler.r.info("clients")["blocked_clients"] >= 1, "the reader to block")
    assert scheduler.r.info("clients")["blocked_clients"] == 1
    xreads_before = _xread_calls(scheduler.r)
    steps = max(len(w) for w in words.values())
    for step in range(steps):
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
    # one XREAD per step or so for all 16 streams (one per stream per step would be 16x)
    assert _xread_calls(scheduler.r) - xreads_before <= 2 * steps + 4


def _xread_calls(r) -> int:
    return r.info("commandstats").get("cmdstat_xread", {}).get("calls", 0)


def test_a_default_stream_is_plain_data_lines_for_line_based_parsers(start_gateway, redis_proc,
                                                                     tokenizer):
    """vLLM's benchmark clients and shell scripts strip "data: " from each line."""
    gw = start_gateway(keepalive_s=0.05)       # a keep-alive would be due at every pause
    sched = FakeScheduler(redis_proc.url, gw.config.redis_prefix)
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        fut = pool.submit(c.post, "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 9,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        rid = sched.take().request.request_id
        toks = ids_of(tokenizer, "Plain lines only")
        for t in toks:
            sched.emit(rid, SeqDelta(0, [t]))
            time.sleep(0.15)                       # silence longer than keepalive_s
        sched.emit(rid, SeqDelta(0, [], finish_reason="stop", stop_token_id=2), finished=True)
        r = fut.result(10)
    assert "x-resumable-stream" not in r.headers
    lines = [line for line in r.text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Plain lines only"
    # continuous_usage_stats: every chunk carries the usage so far, the last one the total
    completions = [c["usage"]["completion_tokens"] for c in chunks]
    assert completions == sorted(completions) and completions[-1] == len(toks) + 1
    assert all(c["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"] > 0
               for c in chunks)


IGNORED_FIELDS = [("store", True), ("metadata", {"team": "a"}), ("user", "u-1"),
                  ("service_tier", "auto"), ("parallel_tool_calls", False),
                  ("reasoning_effort", "low"), ("prompt_cache_key", "k"), ("functions", None),
                  ("frobnicate", 1), ("stream_options", {"include_usage": True, "x": 1})]


@pytest.mark.parametrize("name,value", IGNORED_FIELDS, ids=[f[0] for f in IGNORED_FIELDS])
def test_fields_a_local_server_has_no_use_for_are_accepted(http, scheduler, name, value):
    for path, body in (("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "hi", "tool_call_id": "t"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        fut = start(http, path, dict(body, max_tokens=2, **{name: value}))
        rid = scheduler.take().request.request_id
        scheduler.emit(rid, SeqDelta(0, [], finish_reason="length"), finished=True)
        r = fut.result(10)
        assert r.status_code == 200, r.text


def test_a_client_request_id_names_the_request_and_is_echoed(http, scheduler):
    fut = start(http, "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                headers={"X-Request-Id": "trace.42-a"})
    req = scheduler.take().request
    assert req.request_id == "cmpl-trace.42-a"
    scheduler.emit(req.request_id, SeqDelta(0, [], finish_reason="length"), finished=True)
    r = fut.result(10)
    assert r.headers["x-request-id"] == "trace.42-a" and r.json()["id"] == "cmpl-trace.42-a"
    again = http.post("/v1/completions", json={"prompt": "hi"},
                      headers={"X-Request-Id": "trace.42-a"})
    assert again.status_code == 400 and again.json()["error"]["code"] == "duplicate_request_id"


@pytest.mark.parametrize("stream", [False, True])
def test_several_prompts_fan_out_and_number_choices_prompt_major(http, scheduler, tokenizer,
                                                                 stream):
    prompts = ["one", [7, 8, 9], "three"]
    fut = start(http, "/v1/completions", {"prompt": prompts, "n": 2, "max_tokens": 3,
                                          "stream": stream,
                                          "stream_options": {"include_usage": True}})
    taken = sorted((scheduler.take().request for _ in prompts), key=lambda r: r.request_id)
    assert [r.prompt_token_ids for r in taken] == [tokenizer.encode("one"), [7, 8, 9],
                                                   tokenizer.encode("three")]
    words = {}
    for p, req in enumerate(taken):
        for j in range(2):
            words[p * 2 + j] = ids_of(tokenizer, f" p{p}c{j}")
        scheduler.emit(req.request_id, *[SeqDelta(j, words[p * 2 + j], finish_reason="length")
                                          for j in range(2)], finished=True)
    r = fut.result(10)
    if stream:
        events = [e for _i, e in data_events(r.text)]
        assert events[-1] == "[DONE]"
        usage = events[-2]["usage"]
        texts = {}
        for e in events[:-2]:
            for c in e["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    else:
        body = r.json()
        assert [c["index"] for c in body["choices"]] == list(range(6))
        texts = {c["index"]: c["text"] for c in body["choices"]}
        usage = body["usage"]
    assert texts == {i: tokenizer.decode(w) for i, w in words.items()}
    prompt_tokens = sum(len(r.prompt_token_ids) for r in taken)
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == sum(len(w) for w in words.values())


def test_a_disconnect_aborts_every_prompt_of_the_request(gateway, scheduler):
    def client():
        with httpx.Client(base_url=gateway.url, timeout=2) as c:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 50},
                       timeout=0.5)

    fut = pool.submit(client)
    rids = [scheduler.take().request.request_id for _ in range(3)]
    fut.result(10)
    for rid in rids:
        scheduler.wait_abort(rid, timeout=3)


def test_echo_with_logprobs_and_zero_max_tokens_scores_the_prompt(http, scheduler, tokenizer):
    prompt = tokenizer.encode("The cat sat")
    fut = start(http, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1,
                                          "max_tokens": 0})
    req = scheduler.take().request
    assert req.sampling.max_tokens == 1 and req.sampling.prompt_logprobs == 1
    plp = [None] + [TokenLogprob(t, -1.0 - i, [[t, -1.0 - i]]) for i, t in enumerate(prompt[1:])]
    scheduler.emit(req.request_id, SeqDelta(0, [5], [TokenLogprob(5, -0.1, [[5, -0.1]])],
                                            finish_reason="length"),
                   finished=True, prompt_logprobs=plp)
    body = fut.result(10).json()
    choice = body["choices"][0]
    assert choice["text"] == "The cat sat" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([t]) for t in prompt]
    assert lp["token_logprobs"] == [None] + [-1.0 - i for i in range(len(prompt) - 1)]
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"]) == len(prompt)
    assert lp["text_offset"][0] == 0 and len(lp["text_offset"]) == len(prompt)
    assert body["usage"]["completion_tokens"] == 0


def test_vllm_sampling_extensions_reach_the_wire(http, scheduler, tokenizer):
    prompt = tokenizer.encode("one two three four five")
    fut = start(http, "/v1/completions", {
        "prompt": prompt, "max_tokens": 2, "logit_bias": {"17": -100, "42": 5.5},
        "allowed_token_ids": [17, 42, 99], "bad_words": ["hello", "big cat"],
        "truncate_prompt_tokens": 2, "return_tokens_as_token_ids": True, "logprobs": 0})
    req = scheduler.take().request
    s = req.sampling
    assert req.prompt_token_ids == prompt[-2:]
    assert s.logit_bias == {17: -100.0, 42: 5.5} and s.allowed_token_ids == [17, 42, 99]
    for word in ("hello", " hello", "big cat", " big cat"):
        assert tokenizer.encode(word, add_special_tokens=False) in s.bad_words_ids
    scheduler.emit(req.request_id, SeqDelta(0, [42], [TokenLogprob(42, -0.5)],
                                            finish_reason="length"), finished=True)
    assert fut.result(10).json()["choices"][0]["logprobs"]["tokens"] == ["token_id:42"]


def test_chat_continue_final_message_and_template_kwargs_shape_the_prompt(http, scheduler,
                                                                          tokenizer):
    msgs = [{"role": "user", "content": "Colour?"}, {"role": "assistant", "content": "Blue and"}]
    fut = start(http, "/v1/chat/completions", {
        "messages": msgs, "continue_final_message": True, "add_generation_prompt": False,
        "chat_template_kwargs": {"custom_flag": True}, "max_tokens": 2})
    req = scheduler.take().request
    expected = tokenizer.apply_chat_template(msgs, tokenize=False, continue_final_message=True,
                                             add_generation_prompt=False)
    assert tokenizer.decode(req.prompt_token_ids) == expected
    assert expected.endswith("Blue and")          # the assistant turn is left open
    scheduler.emit(req.request_id, SeqDelta(0, [], finish_reason="length"), finished=True)
    assert fut.result(10).status_code == 200


def test_outputs_read_at_once_reach_a_plain_stream_as_one_event(http, scheduler, tokenizer):
    body = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 30}
    with http.stream("POST", "/v1/completions", json=body) as live:
        rid = scheduler.take().request.request_id
        ids = ids_of(tokenizer, "one two three four five")
        scheduler.emit(rid, SeqDelta(0, ids[:1]))
        lines = live.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        # the rest in one transaction: the gateway's blocked XREAD returns them together
        pipe = scheduler.r.pipeline(transaction=True)
        for k, t in enumerate(ids[1:], 1):
            last = k == len(ids) - 1
            out = RequestOutput(rid, [SeqDelta(0, [t], finish_reason="length" if last else None)],
                                finished=last)
            pipe.xadd(scheduler.keys.output(rid), {b"m": encode(out)})
        pipe.execute()
        events = data_events("\n".join([first, *lines]) + "\n")
    texts = [e["choices"][0]["text"] for _id, e in events if e != "[DONE]"]
    assert texts == [tokenizer.decode(ids[:1]), tokenizer.decode(ids[1:])], \
        "the four outputs read at once: one event"
    assert "".join(texts) == tokenizer.decode(ids)
    assert events[-2][1]["choices"][0]["finish_reason"] == "length"
    assert all(i is None for i, _ in events) and events[-1][1] == "[DONE]"
