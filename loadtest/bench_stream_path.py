"""The gateway's CPU per streamed token on its own: no sockets, no Redis, one process.

bench_frontend.py measures the whole front end, where the kernel's socket writes, Redis and
the clients share the cores and a loaded machine makes the gateway fall behind (then it
coalesces tokens, and its cost per token drops). This isolates the Python path that every
token takes through the gateway, with nothing else in the process:

    fake XREAD (one entry per followed stream per read, the scheduler's encoding)
      └─▶ the real StreamFollower ──▶ the real GenerationStream (plain SSE, completions)
                                          └─▶ a send that counts and hashes the bytes

--streams requests each get --rounds tokens (the last one finishes the request); the
figure is the process's CPU time from the first read to the last [DONE], per token.
The hash of every byte sent is printed: two trees that stream the same bytes print the
same hash.

    python loadtest/bench_stream_path.py [--streams 256] [--rounds 50] [--repeats 3]
        [--baseline REV] [--json]

--baseline REV runs the same measurement on git revision REV (a temporary worktree),
alternating with the current tree, --repeats times each; the median of each is reported
with the ratio. Figures: docs/overhead.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(streams: int, rounds: int) -> dict:
    """In the tree on sys.path: stream `rounds` tokens to each of `streams` requests."""
    import asyncio
    import hashlib
    import time
    from types import SimpleNamespace

    from services.gateway.config import GatewayConfig
    from services.gateway.detokenizer import TokenVocab
    from services.gateway.follower import StreamFollower
    from services.gateway.metrics import GatewayMetrics
    from services.gateway.stream import GenerationStream, Part
    from shared.messages import RequestOutput, SeqDelta, StreamHeader
    from shared.model_source import load_tokenizer, resolve_model
    from shared.redis_keys import MSG_FIELD, RedisKeys
    from shared.wire import encode

    vocab = TokenVocab(load_tokenizer(resolve_model("SmolLM2-135M-Instruct")))
    token = next(i for i, b in enumerate(vocab.token_bytes) if b == b"a")
    mid = encode(RequestOutput("r", [SeqDelta(0, [token])]))
    last = encode(RequestOutput("r", [SeqDelta(0, [token], finish_reason="length")],
                                finished=True))
    digest, sent = hashlib.sha256(), [0]

    class FakeRedis:
        """XREAD: one new entry for every stream named (the wake stream excepted)."""

        def __init__(self) -> None:
            self.reads = 0
            self.names: dict[str, bytes] = {}    # key -> its bytes, as Redis sends it

        def set_response_callback(self, *_):
            pass

        async def xread(self, streams, count=None, block=None):
            await asyncio.sleep(0)           # a real read yields to the loop too
            self.reads += 1
            data = last if self.reads == rounds else mid
            entry = f"{1000 + self.reads}-0".encode()
            names = self.names
            for k in streams:
                if k not in names:
                    names[k] = k.encode() if ":gateway-wake:" not in k else b""
            return [(names[k], [[entry, [MSG_FIELD, data]]]) for k in streams if names[k]]

    async def main() -> float:
        queue = SimpleNamespace(redis=FakeRedis(), keys=RedisKeys("bench"), where="fake")

        async def abort(*_a, **_k):
            pass

        queue.abort = abort
        gw = SimpleNamespace(config=GatewayConfig(), vocab=vocab, metrics=GatewayMetrics(),
                             queue=queue)
        gw.follower = StreamFollower(queue, 2000)
        never = asyncio.get_running_loop().create_future()

        async def receive():
            await never                      # the client never disconnects

        async def send(message):
            body = message.get("body", b"")
            digest.update(body)
            sent[0] += 1

        scope = {"type": "http"}
        try:   # what uvicorn's protocol puts in the scope with the gateway's options
            from services.gateway.limits import WRITABLE, Writable
            scope[WRITABLE] = Writable()
        except ImportError:
            pass
        tasks = []
        for i in range(streams):
            rid = f"cmpl-{i:032x}"
            spec = StreamHeader("completion", rid, "m", 1700000000, 1, 3, stream=True)
            sub = gw.follower.register(rid, "0-1")
            stream = GenerationStream(gw, rid, [Part(spec, "0-1", sub, vocab)])
            tasks.append(asyncio.create_task(stream(scope, receive, send)))
        await asyncio.sleep(0)               # every response waits for its first output
        try:   # the gateway process's collector settings (start-up heap frozen)
            from shared.heap import settle_heap
            settle_heap()
        except ImportError:
            pass
        t0 = time.process_time()
        gw.follower.ensure_reading()
        await asyncio.gather(*tasks)
        return time.process_time() - t0

    try:
        import uvloop
        cpu_s = uvloop.run(main())
    except ImportError:
        cpu_s = asyncio.run(main())
    return {"cpu_us_per_token": 1e6 * cpu_s / (streams * rounds), "sends": sent[0],
            "sha256": digest.hexdigest()[:16]}


def measure(tree: Path, args) -> dict:
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--role", "run",
                          "--streams", str(args.streams), "--rounds", str(args.rounds)],
                         cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["bench", "run"], default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=50, help="tokens per stream")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", default=None, help="git revision to run as the baseline")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.role == "run":
        print(json.dumps(run_once(args.streams, args.rounds)))
        return
    trees = {"current": REPO}
    base = None
    if args.baseline:
        base = Path(tempfile.mkdtemp(prefix="bench-stream-path-")) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(base),
                        args.baseline], check=True)
        trees = {"baseline": base, "current": REPO}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    try:
        for _ in range(args.repeats):          # alternating: the load changes over time
            for label, tree in trees.items():
                runs[label].append(measure(tree, args))
    finally:
        if base is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)])
    out = {label: {"cpu_us_per_token": round(statistics.median(
                       r["cpu_us_per_token"] for r in rs), 2),
                   "runs_us": [round(r["cpu_us_per_token"], 2) for r in rs],
                   "sends": rs[0]["sends"], "sha256": rs[0]["sha256"]}
           for label, rs in runs.items()}
    if base is not None:
        out["speedup"] = round(out["baseline"]["cpu_us_per_token"]
                               / out["current"]["cpu_us_per_token"], 2)
        out["same_bytes"] = out["baseline"]["sha256"] == out["current"]["sha256"]
    sys.path.insert(0, str(REPO))           # (not in the runs: they import their own tree)
    from loadtest.docgen import cpu
    out.update(streams=args.streams, rounds=args.rounds, cpu_model=cpu(),
               loadavg_1m=round(os.getloadavg()[0], 2))
    if args.json:
        print(json.dumps(out))
        return
    for label in trees:
        r = out[label]
        print(f"{label:9} {r['cpu_us_per_token']:8.2f} µs CPU/token  runs {r['runs_us']}  "
              f"sends {r['sends']}  sha256 {r['sha256']}")
    if base is not None:
        print(f"speedup {out['speedup']}x, same bytes: {out['same_bytes']}")
    print(f"{args.streams} streams x {args.rounds} tokens; {out['cpu_model']}, "
          f"load avg {out['loadavg_1m']}")


if __name__ == "__main__":
    main()
