"""Plot decode throughput by batch size from several bench_executor.py --json outputs.

    python loadtest/plot_decode.py OUT/bench_executor_gpu.json:"CUDA graphs" \
        OUT/bench_executor_gpu_eager.json:eager --out docs/gpu_decode.png

(OUT: the folder `loadtest/gpu_checks.sh OUT executor_bench_bf16 executor_eager` wrote.)
"""
from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="FILE.json or FILE.json:label")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--title", default="Executor decode throughput")
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in args.runs:
        path, _, label = run.partition(":")
        res = json.load(open(path))
        where = res.get("gpu", "CPU")
        for dtype, by_batch in res["decode_tok_s"].items():
            pts = sorted((int(b), tps) for b, tps in by_batch.items())
            ax.plot(*zip(*pts), marker="o", label=f"{label or path} ({dtype}, {where})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequences decoding per step")
    ax.set_ylabel("tokens / s")
    ax.set_title(args.title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
