"""fp32 GEMM on the CPU: the engine's own kernel (AVX-512 or AVX2) against oneDNN and MKL, by row count.

    .venv/bin/python loadtest/bench_cpu_gemm.py                 # a table
    .venv/bin/python loadtest/bench_cpu_gemm.py --json          # one JSON object
    .venv/bin/python loadtest/bench_cpu_gemm.py --plot docs/cpu_gemm.png

The shapes are SmolLM2-135M's four projections (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536), 30 distinct copies of each as in the model's 30 layers, so that every
product reads its weight from memory as a decode step does (the weights of a model do
not stay in cache from one step to the next). Each library runs the same inputs on its
own packed copies; the libraries take turns, in alternating order, and each figure is
the best of --reps rounds, since the CPUs may be shared with other work. The figure is
GFLOP/s over all four projections; `vs_onednn` is the engine's kernel divided by oneDNN.

With --bf16 the GEMMs of a bf16 model run beside them, bf16 rows by bf16 weights:
`engine_bf16` (the engine's kernel over bf16 weights widened to fp32, fp32 sums),
`engine_dp_bf16` where the CPU has AVX-512 bf16 (the engine's kernel with the CPU's bf16
dot products, fp32 sums) and `onednn_bf16` where torch packs bf16 for oneDNN on this CPU.

    .venv/bin/python loadtest/bench_cpu_gemm.py --rows 64,256 --bf16 --baseline HEAD~1

--baseline REV builds the kernel source of git revision REV (services/executor/
cpu_kernels.c) beside the current one: its forms of the engine's kernel run in the same
turns, named `engine@REV` (and `engine_bf16@REV`, `engine_dp_bf16@REV`), each with its
own packing of the same weights, and `vs_baseline` gives each form's GFLOP/s over REV's.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.kernel_revision import Using, build_kernels  # noqa: E402
from services.executor import cpu_kernels  # noqa: E402
from services.executor.cpu_gemm import (bf16_packing, onednn_linear,  # noqa: E402
                                        packed_gemm, usable_gemms)

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def libraries(weights: list[torch.Tensor], bf16: bool = False) -> dict[str, list]:
    """For each packed fp32 GEMM usable here (available and correct, as the runner checks
    it): one `run(x)` per weight, packed as the runner packs it; with bf16, also the bf16
    GEMMs usable here (their names end in _bf16 and take bf16 rows)."""
    libs = {gemm: [packed_gemm(gemm, w)[1] for w in weights] for gemm in usable_gemms()}
    forms = {"engine_bf16": False, "engine_dp_bf16": True}
    for name, dp in forms.items():
        if bf16 and cpu_kernels.linear_available() and (not dp or cpu_kernels.dp_available()):
            libs[name] = [
                (lambda x, p=cpu_kernels.pack_linear(w.bfloat16(), dp=dp), n=w.shape[0]:
                 cpu_kernels.linear(x, p, n)) for w in weights]
    if bf16 and bf16_packing():
        libs["onednn_bf16"] = [
            (lambda x, p=torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None):
             onednn_linear(x, p, None, False)) for w in weights]
    return libs


def revision_forms(weights: list[torch.Tensor], bf16: bool, lib, rev: str) -> dict[str, list]:
    """The engine's kernel forms of `lib` (another revision's library): each weight packed
    by it and each product run by it."""
    def run(x, p, n):
        with Using(lib):
            return cpu_kernels.linear(x, p, n)

    with Using(lib):
        forms = {"engine": (torch.float32, None)}
        if bf16:
            forms["engine_bf16"] = (torch.bfloat16, False)
            if cpu_kernels.dp_available():
                forms["engine_dp_bf16"] = (torch.bfloat16, True)
        return {f"{name}@{rev}": [(lambda x, p=cpu_kernels.pack_linear(w.to(dtype), dp=dp),
                                   n=w.shape[0]: run(x, p, n)) for w in weights]
                for name, (dtype, dp) in forms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64,128,256,512,2048")
    ap.add_argument("--layers", type=int, default=30, help="distinct copies of each weight")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--bf16", action="store_true", help="the bf16 GEMMs as well")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", help="write a PNG of GFLOP/s by rows here")
    ap.add_argument("--baseline", metavar="REV",
                    help="also time the engine's kernel of git revision REV, in the same turns")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    torch.manual_seed(0)
    weights = {name: [torch.randn(n, k) for _ in range(args.layers)]
               for name, (n, k) in SHAPES.items()}
    runs = {name: libraries(w, args.bf16) for name, w in weights.items()}
    tmp = tempfile.TemporaryDirectory()
    if args.baseline:
        if cpu_kernels.kernels() is None or not cpu_kernels.linear_available():
            sys.exit("bench_cpu_gemm: the engine's kernel is not built here: no --baseline")
        base = build_kernels(args.baseline, Path(tmp.name))
        for name, w in weights.items():
            runs[name].update(revision_forms(w, args.bf16, base, args.baseline))
    libs = list(next(iter(runs.values())))
    res: dict = {"threads": torch.get_num_threads(), "layers": args.layers, "gflops": {}}
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = {name: torch.randn(m, k) for name, (_, k) in SHAPES.items()}
            x16 = {name: x.bfloat16() for name, x in xs.items()}
            flops = sum(2 * m * n * k * args.layers for n, k in SHAPES.values())
            best = dict.fromkeys(libs, float("inf"))
            for rep in range(args.reps):
                for lib in (libs if rep % 2 == 0 else libs[::-1]):
                    t0 = time.perf_counter()
                    inputs = x16 if lib.split("@")[0].endswith("_bf16") else xs
                    for name in SHAPES:
                        for run in runs[name][lib]:
                            run(inputs[name])
                    best[lib] = min(best[lib], time.perf_counter() - t0)
            res["gflops"][m] = {lib: flops / t / 1e9 for lib, t in best.items()}
            line = "  ".join(f"{lib} {g:6.1f}" for lib, g in res["gflops"][m].items())
            ratio = ""
            if "engine" in best and "onednn" in best:
                ratio = f"  engine/onednn {best['onednn'] / best['engine']:.2f}x"
            say(f"{m:5d} rows: {line} GFLOP/s{ratio}")
    if args.baseline:
        res["baseline"] = args.baseline
        res["vs_baseline"] = {m: {lib: g[lib] / g[f"{lib}@{args.baseline}"] for lib in g
                                  if f"{lib}@{args.baseline}" in g}
                              for m, g in res["gflops"].items()}
        for m, ratios in res["vs_baseline"].items():
            say(f"{m:5d} rows, against {args.baseline}: "
                + "  ".join(f"{lib} {r:.3f}x" for lib, r in ratios.items()))
    if "engine" in libs and "onednn" in libs:
        res["vs_onednn"] = {m: g["engine"] / g["onednn"] for m, g in res["gflops"].items()}
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6))
        rows = list(res["gflops"])
        for lib in libs:
            ax.plot(rows, [res["gflops"][m][lib] for m in rows], marker="o", label=lib)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows (tokens in the step)")
        ax.set_ylabel("GFLOP/s")
        kind = "fp32 and bf16 GEMMs" if args.bf16 else "fp32 GEMM"
        ax.set_title(f"{kind}, SmolLM2 projections, weights from memory, "
                     f"{res['threads']} threads", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        say(f"wrote {args.plot}")
    if args.json:
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
