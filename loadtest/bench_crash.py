"""Crashes under `pagedserve serve`: kill -9 of the executor, the scheduler or Redis while
16 greedy streams run and 16 requests queue, and two stacks on one host.

    .venv/bin/python loadtest/bench_crash.py            # every scenario, one JSON line each
    .venv/bin/python loadtest/bench_crash.py executor   # one: executor | scheduler | redis | two

For each kill: the same 32 requests run first with no crash (the reference), then again
with the kill once 2 of them stream; `serve` restarts the service. Reported: requests that
ended with an error, hung (no end within --hang-s), or differ from the reference; the
longest gap between two chunks of one stream (the pause the crash cost a client); and the
time from the kill to /health 200 again. `two`: a second `serve` with the default internal
ports starts while the first serves; the first must keep serving correct output.
Figures: docs/reliability.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.docgen import commit, cpu  # noqa: E402
from tests.serve_stack import Serve  # noqa: E402
from tests.test_faults import launch  # noqa: E402

RUNNING, QUEUED, NEW_TOKENS, HANG_S = 16, 16, 48, 600
PROMPTS = [f"Story number {i}: once upon a time" for i in range(RUNNING + QUEUED)]


def run(url: str, kill=None):
    outs, threads = launch(url, PROMPTS, NEW_TOKENS)
    if kill is not None:
        while sum(o.tokens >= 3 for o in outs) < 2:
            time.sleep(0.02)
        kill()
    for t in threads:
        t.join(timeout=HANG_S)
    return outs, sum(t.is_alive() for t in threads)


def max_gap(outs) -> float:
    return max((b - a for o in outs for a, b in zip(o.token_times, o.token_times[1:])),
               default=0.0)


def kill_scenario(name: str) -> dict:
    s = Serve("--max-num-seqs", str(RUNNING)).wait_healthy()
    try:
        ref, _ = run(s.base_url)
        killed = {}

        def kill():
            killed["at"] = time.monotonic()
            s.kill(name)
        outs, hung = run(s.base_url, kill)
        while s.health()[0] != 200:
            time.sleep(0.1)
        back = time.monotonic() - killed["at"]
        return {"kill": name, "requests": len(PROMPTS),
                "errors": sum(o.error is not None for o in outs),
                "error_kinds": sorted({(o.error or "")[:60] for o in outs if o.error}),
                "hung": hung,
                "differ": sum(o.error is None and o.text != r.text for o, r in zip(outs, ref)),
                "reference_errors": sum(r.error is not None for r in ref),
                "max_chunk_gap_s": round(max_gap(outs), 2),
                "max_chunk_gap_reference_s": round(max_gap(ref), 2),
                "healthy_again_after_s": round(back, 2)}
    finally:
        s.stop()


def two_stacks() -> dict:
    first = Serve("--max-num-seqs", str(RUNNING)).wait_healthy()
    try:
        ref, _ = run(first.base_url)
        second = Serve("--max-num-seqs", str(RUNNING))
        try:
            outs, hung = run(first.base_url)
            try:
                second.wait_healthy()
                second_state = "serving"
                again, _ = run(second.base_url)
                second_ok = {"errors": sorted({(o.error or "")[:80] for o in again if o.error}),
                             "differ": sum(o.error is None and o.text != r.text
                                           for o, r in zip(again, ref))}
            except (RuntimeError, AssertionError) as exc:
                second_state, second_ok = f"refused: {exc}", None
        finally:
            second.stop()
        return {"scenario": "two serve, default internal ports", "first_errors":
                sum(o.error is not None for o in outs), "first_hung": hung,
                "first_differ": sum(o.text != r.text for o, r in zip(outs, ref)),
                "second": second_state, "second_run": second_ok}
    finally:
        first.stop()


SCENARIOS = ("executor", "scheduler", "redis", "two")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                    help=f"any of {', '.join(SCENARIOS)} (default: all)")
    which = ap.parse_args().scenarios or SCENARIOS
    for name in which:
        if name not in SCENARIOS:
            ap.error(f"unknown scenario {name!r}: pick from {', '.join(SCENARIOS)}")
    for name in which:
        row = two_stacks() if name == "two" else kill_scenario(name)
        row.update(load_average=os.getloadavg(), cpu=cpu(), commit=commit())
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
