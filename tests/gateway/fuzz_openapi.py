"""Fuzz the gateway from its own /openapi.json with schemathesis (by hand, not in CI).

    python -m tests.gateway.fuzz_openapi [--max-examples 300] [schemathesis flags ...]

Starts a private Redis, the real gateway process (max_model_len 256) and a stand-in
scheduler that answers every request at once with up to 3 tokens, then runs
`schemathesis run --checks all` (the `schemathesis` command must be on PATH, or named by
$SCHEMATHESIS). Expected: no 5xx and every 4xx with the error body. The only rejections
of schema-valid requests are the cross-field rules a schema cannot state (prompt +
max_tokens within the context, best_of > n without beam search, min_tokens <= max_tokens,
top_logprobs needing logprobs).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import httpx
import redis

from shared.messages import GenerationRequest, RequestOutput, SeqDelta
from shared.redis_keys import CONSUMER_GROUP, MSG_FIELD, RedisKeys
from shared.wire import decode, encode
from tests.gateway.conftest import RedisProcess, free_port


def answer_everything(url: str, keys: RedisKeys, stop: threading.Event) -> None:
    r = redis.Redis.from_url(url)
    try:
        r.xgroup_create(keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
    except redis.ResponseError:
        pass
    while not stop.is_set():
        r.hset(keys.schedulers, "fuzz", time.time())
        reply = r.xreadgroup(CONSUMER_GROUP, "fuzz", {keys.requests: ">"}, count=50, block=200)
        for _s, entries in reply or []:
            for eid, f in entries:
                req = decode(f[MSG_FIELD], GenerationRequest)
                k = min(3, req.sampling.max_tokens)
                seqs = [SeqDelta(i, [28, 29, 30][:k], finish_reason="length")
                        for i in range(req.sampling.n)]
                r.xadd(keys.output(req.request_id),
                       {MSG_FIELD: encode(RequestOutput(req.request_id, seqs, finished=True))})
                r.xack(keys.requests, CONSUMER_GROUP, eid)


def main() -> int:
    exe = os.environ.get("SCHEMATHESIS") or shutil.which("schemathesis")
    if exe is None:
        print("schemathesis is not installed: pip install schemathesis (or set $SCHEMATHESIS)",
              file=sys.stderr)
        return 2
    rp = RedisProcess()
    rp.start()
    port = free_port()
    env = dict(os.environ, REDIS_URL=rp.url, PAGEDSERVE_PORT=str(port),
               PAGEDSERVE_LOG_LEVEL="warning", PAGEDSERVE_MAX_MODEL_LEN="256")
    gw = subprocess.Popen([sys.executable, "-m", "services.gateway.app"], env=env)
    stop = threading.Event()
    threading.Thread(target=answer_everything, args=(rp.url, RedisKeys(), stop),
                     daemon=True).start()
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ping").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        args = sys.argv[1:] or ["--max-examples", "300"]
        return subprocess.call([exe, "run", f"http://127.0.0.1:{port}/openapi.json",
                                "--checks", "all", "--workers", "2", *args])
    finally:
        stop.set()
        gw.terminate()
        gw.wait(10)
        rp.stop()


if __name__ == "__main__":
    sys.exit(main())
