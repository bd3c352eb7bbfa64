"""Gateway overhead benchmark: real gateway process, real Redis, a stand-in scheduler.

    python -m tests.gateway.bench_gateway [--streams 64] [--tokens 64] [--step-ms 20]

The stand-in scheduler behaves like a batched engine: every `step_ms` it appends one
token to every running request's output stream (one pipelined round trip per step) until
the request's max_tokens.
Measured, from the clients' side:
  - admission: client send -> GenerationRequest XADDed (Redis's clock in its entry id, ms);
  - delivery: XADD of an output (its entry id holds Redis's clock in ms) -> the SSE
    event carrying it reaches the client (ms, 1 ms resolution);
  - abort: client disconnect -> AbortRequest in Redis (ms);
  - tokens/s delivered, and the gateway process's CPU seconds per 1,000 tokens.
Not a pytest module: run it by hand; it prints one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import httpx
import redis

from shared.messages import AbortRequest, GenerationRequest, RequestOutput, SeqDelta
from shared.redis_keys import CONSUMER_GROUP, MSG_FIELD, RedisKeys
from shared.wire import decode, encode
from tests.gateway.conftest import RedisProcess, free_port


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p / 100 * len(xs)))], 2) if xs else float("nan")


class SteppedScheduler(threading.Thread):
    def __init__(self, url: str, keys: RedisKeys, step_ms: float) -> None:
        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(url)
        self.keys, self.step_s = keys, step_ms / 1000
        self.budget: dict[str, int] = {}          # request id -> its max_tokens
        self.arrivals: dict[str, float] = {}      # request id -> Redis time of its XADD (s)
        self.parsed: dict[str, float] = {}        # request id -> when the gateway parsed it
        self.running: dict[str, int] = {}         # request id -> tokens sent
        self.stop = False
        try:
            self.r.xgroup_create(keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError:
            pass

    def run(self) -> None:
        token_ids = [28, 29, 30, 31, 32, 33, 34, 35]
        while not self.stop:
            t0 = time.monotonic()
            pipe = self.r.pipeline(transaction=False)
            pipe.hset(self.keys.schedulers, "bench", time.time())
            pipe.xreadgroup(CONSUMER_GROUP, "bench", {self.keys.requests: ">"}, count=1000)
            pipe.xrange(self.keys.aborts)
            _, got, aborts = pipe.execute()
            for _s, entries in got or []:
                for eid, f in entries:
                    req = decode(f[MSG_FIELD], GenerationRequest)
                    self.arrivals[req.request_id] = int(eid.split(b"-")[0]) / 1000
                    self.parsed[req.request_id] = req.arrival_time
                    self.running[req.request_id] = 0
                    self.budget[req.request_id] = req.sampling.max_tokens
            for _eid, f in aborts:
                self.running.pop(decode(f[MSG_FIELD], AbortRequest).request_id, None)
            pipe = self.r.pipeline(transaction=False)
            for rid, sent in list(self.running.items()):
                last = sent + 1 == self.budget[rid]
                out = RequestOutput(rid, [SeqDelta(0, [token_ids[sent % 8]],
                                                   finish_reason="length" if last else None)],
                                    finished=last)
                pipe.xadd(self.keys.output(rid), {MSG_FIELD: encode(out)})
                self.running[rid] = sent + 1
                if last:
                    del self.running[rid]
            pipe.execute()
            time.sleep(max(0.0, self.step_s - (time.monotonic() - t0)))


async def stream_one(client: httpx.AsyncClient, tokens: int, lat: list[float],
                     admission: dict) -> int:
    body = {"prompt": "hello", "max_tokens": tokens, "stream": True, "ignore_eos": True}
    sent = time.time()
    n = 0
    # a resumable stream: its event ids (Redis entry ids) carry the time each token was written
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"X-Resumable-Stream": "true"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        admission[r.headers["x-request-id"]] = sent
        async for line in r.aiter_lines():
            if line.startswith("id: "):
                lat.append(time.time() * 1000 - int(line[4:].split("-")[0]))
            elif line.startswith("data: {"):
                n += 1
    return n


async def disconnect_one(client: httpx.AsyncClient, sched: SteppedScheduler) -> float:
    body = {"prompt": "hello", "max_tokens": 1000, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        rid = r.headers["x-request-id"]
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                break
    closed = time.monotonic()
    while time.monotonic() - closed < 5:
        if any(decode(f[MSG_FIELD], AbortRequest).request_id == rid
               for _e, f in sched.r.xrange(sched.keys.aborts)):
            return (time.monotonic() - closed) * 1000
        await asyncio.sleep(0.001)
    return float("inf")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=20.0)
    args = ap.parse_args()
    rp = RedisProcess()
    rp.start()
    port = free_port()
    env = dict(os.environ, REDIS_URL=rp.url, PAGEDSERVE_REDIS_PREFIX="bench",
               PAGEDSERVE_PORT=str(port), PAGEDSERVE_LOG_LEVEL="warning")
    gw = subprocess.Popen([sys.executable, "-m", "services.gateway.app"], env=env,
                          stderr=open(os.environ.get("BENCH_GATEWAY_LOG", os.devnull), "w"))
    sched = SteppedScheduler(rp.url, RedisKeys("bench"), args.step_ms)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(base + "/ping").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        sched.start()

        async def run():
            limits = httpx.Limits(max_connections=args.streams + 8)
            async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as c:
                lat: list[float] = []
                admission: dict[str, float] = {}
                await stream_one(c, 4, [], {})                    # warm-up
                cpu0, t0 = cpu_seconds(gw.pid), time.monotonic()
                counts = await asyncio.gather(*[stream_one(c, args.tokens, lat, admission)
                                                for _ in range(args.streams)])
                wall, cpu = time.monotonic() - t0, cpu_seconds(gw.pid) - cpu0
                aborts = [await disconnect_one(c, sched) for _ in range(10)]
                return lat, admission, counts, wall, cpu, aborts

        lat, admission, counts, wall, cpu, aborts = asyncio.run(run())
        answered = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in
                    httpx.get(base + "/metrics").text.splitlines()
                    if ln.startswith("pagedserve:gateway_requests_total")}
        adm = [(sched.arrivals[r] - t) * 1000 for r, t in admission.items() if r in sched.arrivals]
        inside = [(sched.arrivals[r] - sched.parsed[r]) * 1000 for r in admission
                  if r in sched.arrivals]
        tokens = sum(counts)
        print(json.dumps({
            "streams": args.streams, "tokens_per_stream": args.tokens, "step_ms": args.step_ms,
            "tokens_delivered": tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1),
            "gateway_cpu_s_per_1k_tokens": round(cpu / tokens * 1000, 3),
            "delivery_ms_p50": pct(lat, 50), "delivery_ms_p99": pct(lat, 99),
            "admission_ms_p50": pct(adm, 50), "admission_ms_p99": pct(adm, 99),
            "parse_to_enqueue_ms_p50": pct(inside, 50), "parse_to_enqueue_ms_p99": pct(inside, 99),
            "abort_ms_median": round(statistics.median(aborts), 1),
            "abort_ms_max": round(max(aborts), 1),
            "gateway_answered": answered, "loadavg_1m": os.getloadavg()[0]}))
    finally:
        sched.stop = True
        gw.terminate()
        gw.wait(10)
        rp.stop()


if __name__ == "__main__":
    main()
