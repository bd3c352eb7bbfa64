"""How long `pagedserve serve` takes to be healthy, and what each service holds once it is.

Each start is `python -m services.launcher serve` as a user runs it (its own private
Redis, free ports, the bundled model unless --model), timed from the spawn to the first
200 of `/health`; then each service's resident memory (VmRSS) and whether torch is mapped
in it are read from /proc, and the stack is stopped.

    python loadtest/bench_startup.py [--rounds 4] [--baseline REV] [--json]

--baseline REV starts the code of git revision REV (a temporary worktree) in turn with the
checkout, --rounds times each.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest import docgen, serve_proc  # noqa: E402
from services.launcher import free_port  # noqa: E402


def memory(pid: int) -> dict:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return {}
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    return {"rss_mib": round(rss / 1024, 1), "torch": "libtorch" in maps}


def one_start(tree: Path, model: str | None) -> dict:
    port = free_port()
    flags = ["--log-level", "warning"] + (["--model", model] if model else [])
    before = set(map(int, filter(str.isdigit, os.listdir("/proc"))))
    proc = serve_proc.start(tree, port, flags)
    try:
        healthy_s = serve_proc.wait_healthy(proc, port)
        mem = {}
        # this stack's services: the ones that were not there before (a quiet host)
        for name, procs in serve_proc.service_pids().items():
            new = [pid for pid, _argv in procs if pid not in before]
            if new:
                mem[name] = memory(new[0])
        return {"healthy_s": round(healthy_s, 2), "services": mem}
    finally:
        serve_proc.stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--baseline", default=None, help="git revision to start in turn")
    ap.add_argument("--model", default=None, help="--model of serve (default: the bundled one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    runs = []
    with docgen.trees(args.baseline) as trees:
        for r in range(args.rounds):
            for tree, label in docgen.in_turn(trees, r):
                row = {"label": label, **one_start(tree, args.model)}
                runs.append(row)
                if not args.json:
                    mem = ", ".join(f"{k} {v['rss_mib']} MiB" + (" (torch)" if v["torch"]
                                                                   else "")
                                    for k, v in sorted(row["services"].items()))
                    print(f"{label}: healthy after {row['healthy_s']} s; {mem}", flush=True)
    labels = list(dict.fromkeys(r["label"] for r in runs))
    medians = {lab: round(statistics.median(r["healthy_s"] for r in runs
                                            if r["label"] == lab), 2) for lab in labels}
    out = {"cpu": docgen.cpu(), "runs": runs, "healthy_s_median": medians}
    print(json.dumps(out, indent=2) if args.json else
          "medians: " + ", ".join(f"{k} {v} s" for k, v in medians.items()))


if __name__ == "__main__":
    main()
