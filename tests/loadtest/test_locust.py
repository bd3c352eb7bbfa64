"""The Locust load test, run headless in a subprocess (Locust monkey-patches the process with
gevent, so it never runs inside pytest's own).

- `test_streaming_load_against_the_stack_has_no_failures` is the acceptance run: the real
  stack (gateway, Redis, scheduler, executor) from the `stack` fixture of tests/conftest.py.
- `test_locustfile_parser_*` runs the same locustfile against `StandInSSEServer`, a tiny
  server defined here only to unit-test the locustfile's SSE parsing and failure rules.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"


def run_locust(host: str, out: Path, *, users: int, spawn_rate: int, run_time: str,
               stop_timeout: int, env: dict[str, str], timeout: float) -> dict:
    """Run Locust headless; return {"stats": [...], "failures": [...], "rc", "log"}."""
    prefix = out / "locust"
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
           "-u", str(users), "-r", str(spawn_rate), "-t", run_time,
           "--stop-timeout", str(stop_timeout), "--host", host,
           "--json-file", str(prefix), "--csv", str(prefix), "--only-summary",
           "--loglevel", "WARNING"]
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("LOCUST_", "PAGEDSERVE_LOADTEST_", "PAGEDSERVE_API_KEY"))}
    proc = subprocess.run(cmd, cwd=out, env={**full_env, **env}, capture_output=True,
                          text=True, timeout=timeout)
    stats_file = prefix.with_suffix(".json")
    assert stats_file.exists(), f"locust wrote no stats (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    with open(f"{prefix}_failures.csv", newline="") as f:
        failures = list(csv.DictReader(f))
    return {"stats": json.loads(stats_file.read_text()), "failures": failures,
            "rc": proc.returncode, "log": proc.stderr[-3000:]}


def by_type(stats: list[dict], request_type: str) -> list[dict]:
    return [s for s in stats if s["method"] == request_type]


def total(entries: list[dict], key: str) -> int:
    return sum(e[key] for e in entries)


def median_ms(entries: list[dict]) -> float:
    """Median over the merged response-time histograms of several stats entries."""
    hist: dict[float, int] = {}
    for e in entries:
        for ms, n in e["response_times"].items():
            hist[float(ms)] = hist.get(float(ms), 0) + n
    half, seen = sum(hist.values()) / 2, 0
    for ms in sorted(hist):
        seen += hist[ms]
        if seen >= half:
            return ms
    raise AssertionError("no samples")


# ---------------------------------------------------------------- acceptance: the real stack


@pytest.mark.timeout(90)
def test_streaming_load_against_the_stack_has_no_failures(stack, tmp_path):
    # 16 new tokens: the CI stack runs a 135M model on 2 CPU cores; streams started in the
    # 20 s get up to 30 s more to finish.
    env = {"PAGEDSERVE_LOADTEST_MAX_TOKENS": "16"}
    if stack.api_key:
        env["PAGEDSERVE_API_KEY"] = stack.api_key
    if getattr(stack, "model", None):
        env["PAGEDSERVE_LOADTEST_MODEL"] = stack.model
    t0 = time.monotonic()
    res = run_locust(stack.base_url, tmp_path, users=8, spawn_rate=4, run_time="20s",
                     stop_timeout=30, env=env, timeout=80)
    stats = res["stats"]
    posts = by_type(stats, "POST")
    assert total(posts, "num_requests") > 0, res["log"]
    assert total(posts, "num_failures") == 0, res["failures"]
    assert total(by_type(stats, "TTFT"), "num_requests") > 0
    assert total(by_type(stats, "ITL"), "num_requests") > 0
    print(f"\nlocust against {stack.base_url}: {total(posts, 'num_requests')} streams in "
          f"{time.monotonic() - t0:.0f} s, TTFT median {median_ms(by_type(stats, 'TTFT')):.0f} ms, "
          f"ITL median {median_ms(by_type(stats, 'ITL')):.0f} ms")


# ---------------------------------------------------------------- parser unit test (stand-in server)


class StandInSSEServer(ThreadingHTTPServer):
    """NOT the gateway: an OpenAI-style SSE server whose replies cycle through one good
    stream and three broken ones, so the locustfile's parser and failure rules can be
    checked in seconds. It checks the API key, model and max_tokens the locustfile sends."""

    daemon_threads = True
    CYCLE = ("ok", "ok", "no_done", "error_event", "no_tokens")
    TOKENS = ["Hel", "lo", " wor", "ld é"]     # 4 text events; "é" is split across chunks
    FIRST_TOKEN_S, GAP_S = 0.05, 0.02

    def __init__(self, api_key: str, model: str, max_tokens: int, min_tokens: int):
        super().__init__(("127.0.0.1", 0), _StandInHandler)
        self.api_key, self.model = api_key, model
        self.max_tokens, self.min_tokens = max_tokens, min_tokens
        self.served = {k: 0 for k in self.CYCLE}
        self.rejected: list[str] = []
        self._n, self._lock = 0, threading.Lock()

    def next_behaviour(self) -> str:
        with self._lock:
            b = self.CYCLE[self._n % len(self.CYCLE)]
            self._n += 1
            self.served[b] += 1
            return b


class _StandInHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"     # chunked transfer, as uvicorn streams

    def log_message(self, *args):    # keep pytest output clean
        pass

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _event(self, payload: str) -> None:
        # Each event goes out in two HTTP chunks, split inside a character's UTF-8 bytes
        # where there is one, so the parser must reassemble lines across chunks.
        data = f"data: {payload}\n\n".encode()
        split_char = data.find("é".encode())
        cut = split_char + 1 if split_char >= 0 else len(data) // 2
        self._chunk(data[:cut])
        self._chunk(data[cut:])

    def do_POST(self):
        srv: StandInSSEServer = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        problem = None
        if self.headers.get("Authorization") != f"Bearer {srv.api_key}":
            problem = "bad api key"
        elif (body.get("model"), body.get("max_tokens"), body.get("min_tokens")) != (
                srv.model, srv.max_tokens, srv.min_tokens):
            problem = f"bad body {body}"
        elif not body.get("stream"):
            problem = "not streaming"
        if problem:
            srv.rejected.append(problem)
            err = json.dumps({"error": {"message": problem}}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(err)))
            self.end_headers()
            self.wfile.write(err)
            return
        chat = self.path == "/v1/chat/completions"
        behaviour = srv.next_behaviour()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk_json(text: str, finish: str | None = None) -> str:
            if chat:
                choice = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            return json.dumps({"id": "x", "object": "chunk", "choices": [choice]}, ensure_ascii=False)

        if chat:   # the role-only first delta carries no text: it must not count as a token
            self._event(json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
        time.sleep(srv.FIRST_TOKEN_S)
        if behaviour == "error_event":
            self._event(json.dumps({"error": {"message": "stand-in failure", "code": 500}}))
        elif behaviour != "no_tokens":
            for i, tok in enumerate(self.server.TOKENS):
                if i:
                    time.sleep(srv.GAP_S)
                self._event(chunk_json(tok))
        self._event(chunk_json("", "length"))
        if behaviour != "no_done":
            self._event("[DONE]")
        self._chunk(b"")   # the zero-length chunk ends the response


@pytest.fixture
def stand_in():
    srv = StandInSSEServer(api_key="test-key", model="stand-in-model", max_tokens=7, min_tokens=2)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.mark.timeout(60)
def test_locustfile_parser_reports_ttft_itl_and_each_broken_stream(stand_in, tmp_path):
    env = {"PAGEDSERVE_API_KEY": "test-key", "PAGEDSERVE_LOADTEST_MODEL": "stand-in-model",
           "PAGEDSERVE_LOADTEST_MAX_TOKENS": "7", "PAGEDSERVE_LOADTEST_MIN_TOKENS": "2"}
    host = f"http://127.0.0.1:{stand_in.server_port}"
    res = run_locust(host, tmp_path, users=2, spawn_rate=2, run_time="3s", stop_timeout=5,
                     env=env, timeout=50)
    stats, served = res["stats"], stand_in.served
    assert stand_in.rejected == []           # key, model, max_tokens and min_tokens were sent
    assert all(served[b] > 0 for b in served), served  # every behaviour was exercised

    posts = by_type(stats, "POST")
    bad = served["no_done"] + served["error_event"] + served["no_tokens"]
    assert total(posts, "num_requests") == sum(served.values())
    assert total(posts, "num_failures") == bad
    messages = " | ".join(f["Error"] for f in res["failures"])
    assert "ended without [DONE]" in messages
    assert "error event: stand-in failure" in messages
    assert "without any token" in messages
    assert res["rc"] != 0                              # Locust's exit code flags the failures

    ttft, itl = by_type(stats, "TTFT"), by_type(stats, "ITL")
    assert total(ttft, "num_requests") == served["ok"]
    assert total(itl, "num_requests") == served["ok"] * (len(StandInSSEServer.TOKENS) - 1)
    assert {e["name"].split()[0] for e in ttft} <= {"chat", "completion"}
    # Tokens are read as they arrive, not when the stream ends: the server waits
    # FIRST_TOKEN_S before the first token and GAP_S between tokens.
    assert median_ms(ttft) >= StandInSSEServer.FIRST_TOKEN_S * 1000 * 0.8
    assert median_ms(itl) >= StandInSSEServer.GAP_S * 1000 * 0.5
