"""CPU to pack the output path's two Redis commands: redis-py's packers against
shared.redis_packing.CommandPacker, in turn, in one process.

    python loadtest/bench_redis_packing.py --json

The commands: the scheduler's publishing EVALSHA for 256 outputs (a stream key, an entry
and a TTL each) and the gateway follower's XREAD of 257 streams (a key and a cursor each).
"Before" is what each client used: the scheduler's blocking client redis-py's own packer
with hiredis (its encoder runs on every argument), the gateway's asyncio pool redis-py's
HiredisRespSerializer without an encoder. Both packers must give the same bytes; the script
checks it before it times them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from redis._parsers.encoders import Encoder  # noqa: E402
from redis.connection import HiredisRespSerializer, PythonRespSerializer  # noqa: E402

from loadtest.docgen import cpu  # noqa: E402
from shared.redis_packing import CommandPacker  # noqa: E402


def commands(n: int) -> dict[str, tuple]:
    keys = [f"ps:out:{i:032x}" for i in range(n + 1)]
    entry = b"\x96" + b"x" * 40                    # an output entry's msgpack bytes
    return {
        "scheduler_evalsha": ("EVALSHA", "f" * 40, n + 2, "ps:claim:sched-0", "ps:requests",
                              *keys[:n], "sched-0/token", "schedulers", "m", n,
                              *[a for _ in range(n) for a in (entry, -600)]),
        "gateway_xread": ("XREAD", "COUNT", 256, "BLOCK", 50, "STREAMS", *keys,
                          *(f"{1_700_000_000_000 + i}-{i}" for i in range(n + 1))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--outputs", type=int, default=256, help="outputs (streams) per command")
    ap.add_argument("--number", type=int, default=200, help="packs per timing")
    ap.add_argument("--rounds", type=int, default=7, help="before/after timings in turn")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    enc = Encoder("utf-8", "strict", False).encode
    before = {"scheduler_evalsha": HiredisRespSerializer(PythonRespSerializer(6000, enc).pack,
                                                         enc),
              "gateway_xread": HiredisRespSerializer()}
    after = CommandPacker()
    out: dict = {"outputs": args.outputs, "cpu": cpu()}
    for name, cmd in commands(args.outputs).items():
        if b"".join(before[name].pack(*cmd)) != b"".join(after.pack(*cmd)):
            sys.exit(f"bench_redis_packing: the two packers disagree on {name}")
        us: dict[str, list[float]] = {"before": [], "after": []}
        for r in range(args.rounds):
            pair = (("before", before[name]), ("after", after))
            for label, packer in pair if r % 2 == 0 else pair[::-1]:
                t = min(timeit.repeat(lambda p=packer: p.pack(*cmd), number=args.number,
                                      repeat=3))
                us[label].append(t / args.number * 1e6)
        b, a = statistics.median(us["before"]), statistics.median(us["after"])
        out[name] = {"us_per_command": {"before": b, "after": a},
                     "us_per_output": {"before": b / args.outputs, "after": a / args.outputs},
                     "speedup": b / a}
    if args.json:
        print(json.dumps(out))
        return
    print(out["cpu"])
    for name in ("scheduler_evalsha", "gateway_xread"):
        r = out[name]
        print(f"{name}: {r['us_per_command']['before']:.1f} -> {r['us_per_command']['after']:.1f}"
              f" us a command, {r['us_per_output']['before']:.2f} -> "
              f"{r['us_per_output']['after']:.2f} us an output ({r['speedup']:.1f}x)")


if __name__ == "__main__":
    main()
