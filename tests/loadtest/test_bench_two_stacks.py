"""bench_two_stacks starts two real `pagedserve serve` stacks and streams the same workload
on one, then on both at once."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_two_stacks_serves_both_and_reports_the_ratio():
    proc = subprocess.run([sys.executable, "loadtest/bench_two_stacks.py", "--requests", "2",
                           "--output-tokens", "4", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    (run,) = out["runs"]
    assert run["alone_tok_s"] > 0 and len(run["per_stack_tok_s"]) == 2
    assert all(t > 0 for t in run["per_stack_tok_s"])
    # The ratio is taken before the two rates are rounded to 0.1 tok/s: at the smoke test's
    # few tok/s that rounding alone moves their quotient by up to ratio * (0.05/t + 0.05/a).
    t, a = run["together_tok_s"], run["alone_tok_s"]
    slack = (t / a) * (0.05 / t + 0.05 / a) + 0.0005
    assert abs(run["together_over_alone"] - t / a) <= slack
    assert out["together_over_alone_median"] == {run["label"]: run["together_over_alone"]}
