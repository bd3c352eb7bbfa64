"""Every Triton kernel compiles for an H100/H200 (sm_90), and the production configurations
do not spill registers: checked on any machine, GPU or not, through Triton's own ptxas."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_hopper_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "kernels.tests.hopper_compile", "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert {r["kernel"] for r in rows} >= {"paged_attention decode", "paged_attention prefill",
                                           "paged_attention split decode", "merge_splits",
                                           "write_kv", "move_blocks"}
    for row in rows:
        # a block may take at most 227 KiB of shared memory on sm_90; more fails at launch
        assert row["shared_bytes"] <= 227 * 1024, f"{row['kernel']} ({row['config']}): {row}"
        if row["stack_bytes"] is None or "fp32" in row["config"]:
            continue    # no cuobjdump in this Triton build / fp32 tiles (exactness over
                        # speed: some Triton versions spill a little there)
        assert row["stack_bytes"] == 0, f"{row['kernel']} ({row['config']}) spills: {row}"
