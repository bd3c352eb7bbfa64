"""SSE body pieces written straight to the socket (limits.BodyWriter) instead of through the
ASGI send chain: the same bytes as uvicorn's own send, and only where send would write."""
from __future__ import annotations

import asyncio
import json
import logging

import httpx
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from services.gateway import limits
from services.gateway.limits import BodyWriter, Writable
from shared.messages import SeqDelta
from tests.gateway.conftest import FakeScheduler


class Wire:
    """A transport that records what is written."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _cycle(wire: Wire, method: str = "POST") -> RequestResponseCycle:
    scope = {"type": "http", "method": method, "path": "/", "headers": [],
             "http_version": "1.1"}
    log = logging.getLogger("test")
    return RequestResponseCycle(scope=scope, transport=wire, flow=FlowControl(wire),
                                logger=log, access_logger=log, access_log=False,
                                default_headers=[], message_event=asyncio.Event(),
                                expect_100_continue=False, keep_alive=True,
                                on_response=lambda: None)


def test_a_written_piece_is_the_bytes_uvicorns_send_writes():
    async def run() -> None:
        by_send, by_writer = Wire(), Wire()
        a, b = _cycle(by_send), _cycle(by_writer)
        start = {"type": "http.response.start", "status": 200,
                 "headers": [(b"content-type", b"text/event-stream")]}
        await a.send(start)
        await b.send(start)
        writer = BodyWriter(b, Writable())
        for piece in (b"data: {\"x\": 1}\n\n", b"d" * 4000, "é\n".encode()):
            await a.send({"type": "http.response.body", "body": piece, "more_body": True})
            assert writer.write(piece)
        await a.send({"type": "http.response.body", "body": b"end", "more_body": False})
        await b.send({"type": "http.response.body", "body": b"end", "more_body": False})
        assert bytes(by_writer.data) == bytes(by_send.data)
        assert b"transfer-encoding: chunked" in by_send.data
    asyncio.run(run())


def test_the_writer_refuses_whatever_send_would_not_write_at_once():
    async def run() -> None:
        wire = Wire()
        cycle, writable = _cycle(wire), Writable()
        writer = BodyWriter(cycle, writable)
        assert not writer.write(b"x"), "before the response started"
        await cycle.send({"type": "http.response.start", "status": 200, "headers": []})
        writable.paused = True
        assert not writer.write(b"x"), "while the socket's buffer is full"
        writable.paused = False
        assert not writer.write(b""), "an empty piece (send writes nothing)"
        cycle.disconnected = True
        assert not writer.write(b"x"), "after the connection was lost"
        cycle.disconnected = False
        assert writer.write(b"x")
        await cycle.send({"type": "http.response.body", "body": b"", "more_body": False})
        assert not writer.write(b"x"), "after the response completed"
        # a body with a content-length is not chunked: only send writes it
        fixed = _cycle(Wire())
        await fixed.send({"type": "http.response.start", "status": 200,
                          "headers": [(b"content-length", b"3")]})
        assert not BodyWriter(fixed, Writable()).write(b"abc")
        n = len(wire.data)
        assert not writer.write(b"more") and len(wire.data) == n
    asyncio.run(run())


def _stream_token_by_token(gw, redis_url: str, ids: list[int]) -> list[str]:
    """A streamed completion through the real gateway, fed by a fake scheduler one token
    at a time (each one's event read before the next is emitted): the texts of its
    events, checked to be `data:` lines ending with [DONE]."""
    sched = FakeScheduler(redis_url, gw.config.redis_prefix)
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        with c.stream("POST", "/v1/completions", json={
                "prompt": "x", "stream": True, "max_tokens": 10}) as live:
            rid = sched.take().request.request_id
            lines = live.iter_lines()
            got = []
            for k, t in enumerate(ids):
                last = k == len(ids) - 1
                sched.emit(rid, SeqDelta(0, [t], finish_reason="length" if last else None),
                           finished=last)
                if not last:      # each token its own event: wait for it before the next
                    got.append(next(line for line in lines if line.startswith("data: ")))
            got += [line for line in lines if line]
    assert all(line.startswith("data: ") for line in got), got
    events = [line[len("data: "):] for line in got]
    assert events[-1] == "[DONE]"
    return [json.loads(d)["choices"][0]["text"] for d in events[:-1]]


def test_a_served_stream_goes_through_the_writer_and_parses(start_gateway, redis_proc,
                                                            tokenizer, monkeypatch):
    """Through the real gateway under uvicorn: the stream's events are written by the
    request's BodyWriter, and a client reads the same stream as ever."""
    written: list[bytes] = []
    real = BodyWriter.write

    def counting(self, body: bytes) -> bool:
        ok = real(self, body)
        if ok:
            written.append(body)
        return ok

    monkeypatch.setattr(limits.BodyWriter, "write", counting)
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    texts = _stream_token_by_token(start_gateway(), redis_proc.url, ids)
    assert "".join(texts) == tokenizer.decode(ids)
    direct = b"".join(written).decode()
    assert len(written) >= len(ids) - 1, "the tokens' events went through the writer"
    for k in range(1, len(ids) - 1):
        assert tokenizer.decode(ids[k:k + 1]) in direct


def test_a_stream_whose_writer_refuses_is_sent_whole_through_send(
        start_gateway, redis_proc, tokenizer, monkeypatch):
    """The follower's reader builds a waiting stream's events and writes them through the
    BodyWriter; where the writer refuses (a full socket, a body it does not frame), they
    go through uvicorn's `send` instead: every token arrives once, in order, and each
    event was offered to the writer first."""
    refused: list[bytes] = []

    def refusing(self, body: bytes) -> bool:
        refused.append(body)
        return False

    monkeypatch.setattr(limits.BodyWriter, "write", refusing)
    ids = tokenizer.encode("one two three four five six", add_special_tokens=False)
    texts = _stream_token_by_token(start_gateway(), redis_proc.url, ids)
    assert "".join(texts) == tokenizer.decode(ids)
    assert len(refused) >= len(ids) - 2, "the reader offered the events to the writer first"
