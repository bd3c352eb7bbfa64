"""A lean streaming client for the benchmarks: HTTP/1.1 over raw asyncio sockets.

A benchmark's clients share the machine with what they measure; httpx spends tens of
microseconds per SSE line, which on a small machine is CPU taken from the servers. This
client de-chunks the body, splits events and parses each `data:` JSON once (orjson when
installed), and records when each event arrived and how many characters of text it held.
"""
from __future__ import annotations

import asyncio
import json
import time

try:
    from orjson import loads
except ImportError:                 # the standard parser: slower, same result
    loads = json.loads


class StreamError(RuntimeError):
    """The server answered with an error status."""


async def stream_completion(host: str, port: int, body: dict, path: str = "/v1/completions"
                            ) -> tuple[str, list[tuple[float, int]]]:
    """POST a streaming request; (X-Request-Id, [(time.time() at arrival, text characters
    of that event)] for every event that carried text). Raises StreamError on a non-200."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    try:
        writer.write(b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % (path.encode(), host.encode(),
                                                      len(payload)) + payload)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status = int(head.split(" ", 2)[1])
        headers = {k.lower(): v for k, _, v in (line.partition(": ")
                                                for line in head.split("\r\n")[1:] if line)}
        if status != 200:
            raise StreamError(f"HTTP {status}: {head[:200]}")
        arrivals: list[tuple[float, int]] = []
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        raw, sse, done = b"", b"", False
        while not done:
            data = await reader.read(1 << 16)
            if not data:
                break
            t = time.time()
            if chunked:
                raw += data
                while (eol := raw.find(b"\r\n")) >= 0:
                    size = int(raw[:eol].split(b";")[0], 16)
                    if len(raw) < eol + 4 + size:
                        break
                    sse += raw[eol + 2:eol + 2 + size]
                    raw = raw[eol + 4 + size:]
                    if size == 0:
                        done = True
                        break
            else:
                sse += data
            *events, sse = sse.split(b"\n\n")
            for ev in events:
                for line in ev.split(b"\n"):
                    if line.startswith(b"data: {"):
                        n = sum(len(c.get("text") or (c.get("delta") or {}).get("content") or "")
                                for c in loads(line[6:])["choices"])
                        if n:
                            arrivals.append((t, n))
                    elif line == b"data: [DONE]":
                        done = True
        return headers.get("x-request-id", ""), arrivals
    finally:
        writer.close()
