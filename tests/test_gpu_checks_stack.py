"""`loadtest/gpu_checks.sh OUT stack` end to end on the CPU (STACK_DEVICE=cpu), its dry run:
a random model with a synthetic tokenizer, then the real stack (Redis, gateway, scheduler,
executor) paged and --contiguous, and the in-process engine, at two batch sizes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stack_check_runs_end_to_end_on_the_cpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, STACK_DEVICE="cpu")
    proc = subprocess.run(["bash", "loadtest/gpu_checks.sh", str(tmp_path / "out"), "stack"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = (tmp_path / "out" / "all.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    res = json.loads((tmp_path / "out" / "bench_stack.json").read_text())
    for system in ("paged", "contiguous", "inprocess"):
        for batch in ("2", "4"):
            fig = res[system][batch]
            assert fig["tok_s"] > 0 and fig["tpot_ms_p50"] > 0, (system, batch, fig)
    assert set(res["paged_over_contiguous"]) == set(res["stack_over_inprocess"]) == {"2", "4"}


def test_a_failed_check_fails_the_script(tmp_path):
    proc = subprocess.run(["bash", "loadtest/gpu_checks.sh", str(tmp_path), "no_such_check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "unknown check no_such_check" in proc.stdout
