"""Locust load test: streaming chat and completions through the OpenAI-compatible API.

    locust -f loadtest/locustfile.py --headless -u 8 -r 4 -t 60s --host http://127.0.0.1:8000

Each user streams requests (`"stream": true`) and reads the server-sent events as they
arrive. Besides the request itself (its time is the whole stream, first byte sent to
`data: [DONE]`), it reports two latencies as their own Locust request types:

    TTFT  time to first token: request sent -> first event that carries text    (ms)
    ITL   inter-token latency: gap between two successive text-bearing events    (ms)

TTFT entries are named "<api> <prompt size>" (prefill cost grows with the prompt), ITL
entries "<api>". A request counts as failed when the status is not 200, an event carries
an error, no event carries text, or the stream ends without `data: [DONE]`.

Options (flag, or environment variable):
    --model       PAGEDSERVE_LOADTEST_MODEL       served model name (SmolLM2-135M-Instruct)
    --max-tokens  PAGEDSERVE_LOADTEST_MAX_TOKENS  new tokens per request (32)
    --min-tokens  PAGEDSERVE_LOADTEST_MIN_TOKENS  sent as `min_tokens` (1); 0 = not sent
    --api-key     PAGEDSERVE_API_KEY              sent as `Authorization: Bearer ...` when set

NOTE: `min_tokens` (a vLLM extension that pagedserve accepts) keeps the end-of-sequence
token from being sampled first. Without it a correct server may legitimately answer a
prompt with zero tokens, which this test would have to count as a failure. Pass
`--min-tokens 0` for a server that rejects the field.
"""
from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable, Iterator

from locust import HttpUser, between, events, task

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
TIMEOUT_S = (10, 120)   # seconds: to connect, and at most between two chunks of a stream

# Prompt sizes, by weight: most chat traffic is short, some carries a document. Lengths are
# in words; with SmolLM2's tokenizer that is about 10, 150 and 575 prompt tokens, so "long"
# stays well inside a 2,048-token context with max_tokens added.
_FILLER = (
    "PagedAttention stores the key and value cache of every sequence in fixed-size blocks "
    "that need not be contiguous, and a block table maps each logical block to a physical "
    "one, the way an operating system maps virtual pages to physical frames. "
).split()
PROMPT_SIZES = {"short": (6, 5), "medium": (120, 3), "long": (480, 2)}   # name: (words, weight)
_QUESTIONS = [
    "Explain in one sentence what a KV cache is.",
    "Write a haiku about a busy GPU.",
    "List three uses of a hash table.",
    "Summarise the text above in one sentence.",
]


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, env_var="PAGEDSERVE_LOADTEST_MODEL",
                        help="served model name sent as 'model'")
    parser.add_argument("--max-tokens", type=int, default=32, env_var="PAGEDSERVE_LOADTEST_MAX_TOKENS",
                        help="max_tokens of every request")
    parser.add_argument("--min-tokens", type=int, default=1, env_var="PAGEDSERVE_LOADTEST_MIN_TOKENS",
                        help="min_tokens of every request (0: the field is not sent)")
    parser.add_argument("--api-key", default="", env_var="PAGEDSERVE_API_KEY", is_secret=True,
                        help="API key, sent as 'Authorization: Bearer <key>' when set")


def make_prompt(size: str, rng: random.Random) -> str:
    """A prompt of about PROMPT_SIZES[size] words: filler context, then a question."""
    words = PROMPT_SIZES[size][0]
    question = rng.choice(_QUESTIONS)
    if words <= len(question.split()):
        return question
    start = rng.randrange(len(_FILLER))
    context = [_FILLER[(start + i) % len(_FILLER)] for i in range(words)]
    return " ".join(context) + "\n\n" + question


# ---------------------------------------------------------------- server-sent events


def sse_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Split a byte stream into lines, whatever the network chunking (a line may span chunks).

    NOTE: splitting bytes, not text, is safe for UTF-8: b"\\n" never occurs inside a
    multi-byte character, while a chunk boundary may.
    """
    pending = b""
    for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if pending:
        yield pending.rstrip(b"\r")


def sse_events(lines: Iterable[bytes]) -> Iterator[tuple[str, str]]:
    """(event type, data) per event; an event ends at a blank line (the SSE framing rules).

    Several `data:` lines of one event are joined with "\\n"; `id:`, `retry:` and comment
    lines (starting with ':') carry nothing this test needs.
    """
    kind, data = "message", []
    for raw in lines:
        line = raw.decode("utf-8", errors="replace")
        if not line:
            if data:
                yield kind, "\n".join(data)
            kind, data = "message", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            data.append(value)
        elif field == "event":
            kind = value
    if data:          # a stream cut without its final blank line still delivers the event
        yield kind, "\n".join(data)


def event_text(payload: dict) -> str:
    """The generated text one OpenAI stream chunk carries (chat delta or completion text)."""
    text = []
    for choice in payload.get("choices") or []:
        delta = choice.get("delta")
        text.append((delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or ""))
    return "".join(text)


def _retry_after(value: str | None) -> float:
    """Seconds to wait from a Retry-After header (delta-seconds form); 1 s if absent."""
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        return 1.0


class StreamError(Exception):
    """The stream broke the OpenAI streaming contract; the message says how."""


# ---------------------------------------------------------------- the user


class StreamingUser(HttpUser):
    """Streams chat completions (weight 3) and text completions (weight 1)."""

    # NOTE: HttpUser (requests/urllib3) rather than FastHttpUser: urllib3 hands over each
    # HTTP chunk as it arrives, while geventhttpclient's read(n) waits for n bytes, which
    # would add the time of several tokens to the measured TTFT.
    think_time = between(0.05, 0.5)   # seconds of think time between requests

    def wait_time(self) -> float:
        # A refused request (429 queue full, 503) is retried after its Retry-After, as the
        # OpenAI SDK does, rather than at once: a closed loop of instant retries would
        # measure the gateway's refusals, not the engine at saturation.
        backoff, self.backoff = self.backoff, 0.0
        return backoff or self.think_time()

    def on_start(self) -> None:
        self.backoff = 0.0
        opts = self.environment.parsed_options
        self.model = getattr(opts, "model", DEFAULT_MODEL)
        self.sampling = {"max_tokens": getattr(opts, "max_tokens", 32)}
        if getattr(opts, "min_tokens", 1) > 0:
            self.sampling["min_tokens"] = opts.min_tokens
        self.headers = {"Accept": "text/event-stream", "Accept-Encoding": "identity"}
        api_key = getattr(opts, "api_key", "")
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.rng = random.Random()

    def _pick_size(self) -> str:
        names = list(PROMPT_SIZES)
        return self.rng.choices(names, weights=[PROMPT_SIZES[n][1] for n in names])[0]

    @task(3)
    def chat(self) -> None:
        size = self._pick_size()
        body = {"model": self.model, "stream": True, **self.sampling,
                "messages": [{"role": "user", "content": make_prompt(size, self.rng)}]}
        self._stream("/v1/chat/completions", "chat", size, body)

    @task(1)
    def completion(self) -> None:
        size = self._pick_size()
        body = {"model": self.model, "stream": True, **self.sampling,
                "prompt": make_prompt(size, self.rng) + "\nAnswer:"}
        self._stream("/v1/completions", "completion", size, body)

    def _stream(self, path: str, api: str, size: str, body: dict) -> None:
        t0 = time.perf_counter()
        with self.client.post(path, json=body, headers=self.headers, stream=True,
                              timeout=TIMEOUT_S, catch_response=True,
                              name=f"{path} [{size}]") as resp:
            nbytes = 0
            try:
                if resp.status_code in (429, 503):
                    self.backoff = _retry_after(resp.headers.get("Retry-After"))
                if resp.status_code != 200:
                    detail = resp.text if resp.status_code else getattr(resp, "error", "no response")
                    raise StreamError(f"HTTP {resp.status_code}: {str(detail or '')[:200]}")

                def counted(chunks):
                    nonlocal nbytes
                    for c in chunks:
                        nbytes += len(c)
                        yield c

                # chunk_size=None: one HTTP chunk at a time, as soon as it arrives.
                lines = sse_lines(counted(resp.iter_content(chunk_size=None)))
                token_times = self._read_stream(sse_events(lines))
            except StreamError as exc:
                resp.failure(str(exc))
                return
            except Exception as exc:   # a broken connection mid-stream is a failed request
                resp.failure(f"stream broken after {nbytes} bytes: {exc!r}")
                return
            # NOTE: the request's entry measures the whole stream, not only the headers.
            resp.request_meta["response_time"] = (time.perf_counter() - t0) * 1000
            resp.request_meta["response_length"] = nbytes
            resp.success()
        self._report("TTFT", f"{api} {size}", (token_times[0] - t0) * 1000)
        for prev, cur in zip(token_times, token_times[1:]):
            self._report("ITL", api, (cur - prev) * 1000)

    @staticmethod
    def _read_stream(stream: Iterable[tuple[str, str]]) -> list[float]:
        """perf_counter() times of the text-bearing events; StreamError on a broken contract."""
        times: list[float] = []
        for kind, data in stream:
            if kind == "error":
                raise StreamError(f"error event: {data[:200]}")
            if data.strip() == "[DONE]":
                if not times:
                    raise StreamError("stream finished without any token")
                return times
            try:
                payload = json.loads(data)
            except ValueError:
                raise StreamError(f"event is not JSON: {data[:200]!r}") from None
            if not isinstance(payload, dict):
                raise StreamError(f"event is not a JSON object: {data[:200]!r}")
            if payload.get("error"):
                err = payload["error"]
                msg = err.get("message", err) if isinstance(err, dict) else err
                raise StreamError(f"error event: {msg}")
            if event_text(payload):
                times.append(time.perf_counter())
        raise StreamError(f"stream ended without [DONE] after {len(times)} token events")

    def _report(self, kind: str, name: str, ms: float) -> None:
        self.environment.events.request.fire(
            request_type=kind, name=name, response_time=ms, response_length=0,
            exception=None, context={})
