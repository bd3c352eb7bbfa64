"""KV-cache memory: PagedAttention's block manager against a contiguous baseline, measured.

The real Scheduler and BlockManager run on a fixed KV budget over seeded workloads (see
loadtest/workloads.py); a length-only executor stands in for the model (it keeps per-seq state
from the plans' diffs, as the real one does, and samples random tokens). Every measured figure
is read from the block manager, once per step, while the step's slots are allocated; the one
analytic figure, the expected parallel-sampling saving, is there as a cross-check.

    waste           allocated-but-unfilled token slots / allocated slots, time-averaged
                    (sum over steps of unfilled / sum over steps of allocated)
    concurrency     requests running at once: the max over the run, and the mean over the
                    steady state ("sustained")
    sharing saving  1 - physical blocks in use / block-table entries (what the same run would
                    hold if every seq had its own copy of every block), summed over every step
                    of the run: the paper's "blocks saved by sharing / blocks without sharing"
                    (Fig. 15)
    prefix hit rate prompt tokens served from the prefix cache / prompt tokens looked up

Time is counted in steps. All requests arrive at step 0 and wait in the queue, so the batch is
as large as the KV budget allows until the queue empties. Waste and concurrency are averaged
over the steady state: from the first step at which as many requests have finished as are
running (the synchronised first wave has turned over) until the queue empties (the drain,
where only the longest requests are left, is excluded). Whole-run figures are reported beside
them.

NOTE: the sharing saving is the other way round: the whole run is the headline, the steady
window the side figure. Sharing is a property of each request's life (its prompt's share of
its blocks falls as its outputs grow), and the run starts and ends empty, so summing over
every step counts every request's whole life exactly once: the figure is what a serving
system holds on average in a stationary load of the same requests, and it matches the block
arithmetic of those requests (`expected_parallel_saving`, reported beside it). The steady
window cuts lives at both ends, starting on the longest requests of the first wave late in
their lives; with ~70 requests running it is also noisy (parts of it differ by 3-4 points).

The contiguous baseline reserves ceil(max_model_len / block_size) blocks per sequence up front
(as systems before vLLM did) and shares nothing.

    python loadtest/kv_memory.py            # table
    python loadtest/kv_memory.py --json     # one JSON object
    python loadtest/kv_memory.py --plot docs/kv_memory.png
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.workloads import WORKLOADS, make_requests  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from services.scheduler.scheduler import Scheduler  # noqa: E402
from shared.messages import (GenerationRequest, SamplingParams,  # noqa: E402
                             StepPlan, StepResult)

# The paper's Fig. 15 bands (OPT-13B): memory saved by sharing, percent, over n / width 2..6.
PAPER_BANDS = {"parallel": {"alpaca": (6.1, 9.8), "sharegpt": (16.2, 30.5)},
               "beam": {"alpaca": (37.6, 55.2), "sharegpt": (44.3, 66.3)}}


class RandomTokenExecutor:
    """Samples a random token for each sampling row of a plan (random top-2k candidates for
    beams), in row order. No model, no pools."""

    def __init__(self, seed: int, vocab: int = 49152) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.beam: dict[int, int] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for sid in plan.finished_seq_ids:
            self.beam.pop(sid, None)
        for ns in plan.new_seqs:
            self.beam[ns.seq_id] = ns.sampling.beam_width
        rng = self.rng
        result = StepResult(plan.step_id)
        for sid in plan.seq_ids[:plan.num_sampling_rows]:      # row r's sample, in row order
            k = self.beam[sid]
            top: list = []
            if k:
                toks = {100 + int(rng.random() * (self.vocab - 200)) for _ in range(2 * k)}
                top = sorted(([t, math.log(rng.random() + 1e-12)] for t in toks),
                             key=lambda p: -p[1])
                token, logprob = top[0]
            else:
                token, logprob = 100 + int(rng.random() * (self.vocab - 200)), -1.0
            result.token_ids.append(token)
            result.logprobs.append(logprob)
            result.top.append(top)
        if not any(result.top):
            result.top = []
        return result


class _Average:
    """Time averages over the steps it is fed."""

    def __init__(self) -> None:
        self.steps = self.alloc = self.filled = self.phys = self.logical = self.running = 0

    def add(self, block_size: int, gpu, running: int) -> None:
        self.steps += 1
        self.alloc += gpu.num_used * block_size
        self.filled += gpu.num_filled_slots
        self.phys += gpu.num_used
        self.logical += gpu.num_refs
        self.running += running

    @property
    def waste_pct(self) -> float:
        return 100.0 * (self.alloc - self.filled) / max(1, self.alloc)

    @property
    def saving_pct(self) -> float:
        return 100.0 * (1 - self.phys / max(1, self.logical))

    @property
    def mean_running(self) -> float:
        return self.running / max(1, self.steps)


@dataclass
class Figures:
    steady: _Average              # the steady-state window
    whole: _Average               # every step
    max_concurrency: int          # requests
    prefix_hit_rate: float
    preemptions: int


def expected_parallel_saving(requests: list[tuple[list[int], int]], n: int,
                             block_size: int) -> float:
    """Blocks saved by parallel sampling, percent, from block arithmetic alone (no scheduler):
    per step of each request's life, the physical blocks its n seqs hold against their
    block-table entries, summed over the requests' lives.

    The scheduler's sharing: the leader prefills prompt_len - 1 tokens alone; the n seqs fork
    there, sharing its full blocks, and each computes the last prompt token itself (the
    partial block is copied on write), then one token per step until max_tokens.
    """
    phys = logical = 0
    for prompt, out_len in requests:
        p = len(prompt)
        first = -(-(p - 1) // block_size)            # the prefill step: the leader alone
        phys += first
        logical += first
        shared = (p - 1) // block_size
        for t in range(out_len):                      # the step computing position p - 1 + t
            per_seq = -(-(p + t) // block_size)
            phys += shared + n * (per_seq - shared)
            logical += n * per_seq
    return 100.0 * (1 - phys / logical)


def run(requests: list[tuple[list[int], int]], cfg: SchedulerConfig, num_blocks: int,
        n: int = 1, beam: int = 0, seed: int = 0) -> Figures:
    """All requests arrive at once (an offline batch): memory, not arrivals, bounds the batch."""
    sched = Scheduler(cfg, num_blocks, num_blocks)
    ex = RandomTokenExecutor(seed)
    for i, (prompt, out_len) in enumerate(requests):
        sp = SamplingParams(n=1 if beam else n, beam_width=beam, max_tokens=out_len)
        sched.add_request(GenerationRequest(f"r{i}", prompt, sp, arrival_time=float(i)))
    gpu = sched.block_manager.gpu
    steady, whole = _Average(), _Average()
    max_conc = finished = 0
    warm = False
    while sched.has_unfinished():
        queued = sched.num_waiting > 0        # before this step's admissions
        plan = sched.schedule()
        if plan is None:
            raise RuntimeError("no progress: the KV budget is too small for one request")
        conc = len(sched.running)
        max_conc = max(max_conc, conc)
        whole.add(cfg.block_size, gpu, conc)
        warm = warm or finished >= conc      # the batch has turned over once
        if warm and queued:
            steady.add(cfg.block_size, gpu, conc)
        finished += sum(1 for o in sched.update(plan, ex.execute(plan)).request_outputs()
                        if o.finished)
    st = sched.stats()
    if st.gpu_blocks_used:
        raise AssertionError(f"{st.gpu_blocks_used} blocks still in use after the run")
    if steady.steps < 0.2 * whole.steps:
        raise RuntimeError(f"steady state too short ({steady.steps} of {whole.steps} steps): "
                           "raise --sharegpt-requests / --alpaca-requests")
    return Figures(steady, whole, max_conc,
                   st.prefix_cache_hits / max(1, st.prefix_cache_queries), st.num_preemptions)


def config(block_size: int, max_model_len: int, contiguous: bool = False,
           prefix_caching: bool = False) -> SchedulerConfig:
    # NOTE: the contiguous baseline reserves everything up front, so the scheduler keeps no
    # admission headroom for it (watermark and growth_reserve apply to paged growth only).
    return SchedulerConfig(block_size=block_size, max_num_seqs=4096,
                           max_num_batched_tokens=4096, max_model_len=max_model_len,
                           contiguous=contiguous, enable_prefix_caching=prefix_caching,
                           preemption_mode="recompute")


def measure(args) -> dict:
    slots, mml = args.kv_slots, args.max_model_len
    counts = {"sharegpt": args.sharegpt_requests, "alpaca": args.alpaca_requests}
    out: dict = {"paged_waste_pct": {}, "contiguous_waste_pct": {},
                 "max_concurrency_paged": {}, "max_concurrency_contiguous": {},
                 "concurrency_ratio": {}, "sustained_concurrency_paged": {},
                 "sustained_concurrency_contiguous": {}, "sustained_concurrency_ratio": {},
                 "parallel_sampling_saving_pct": {}, "beam_saving_pct": {},
                 "paged_waste_whole_run_pct": {}, "contiguous_waste_whole_run_pct": {},
                 "parallel_sampling_saving_expected_pct": {},
                 "parallel_sampling_saving_steady_window_pct": {},
                 "beam_saving_steady_window_pct": {},
                 "prefix_hit_rate": {}, "preemptions_paged": {}, "growth_reserve": {}}
    for name, model in WORKLOADS.items():
        reqs = make_requests(model, counts[name], seed=args.seed, max_len=mml)
        log(f"{name}: paged")
        paged = run(reqs, config(16, mml), slots // 16, seed=args.seed)
        log(f"{name}: paged, block size 8")
        paged8 = run(reqs, config(8, mml), slots // 8, seed=args.seed)
        log(f"{name}: contiguous")
        contig = run(reqs, config(16, mml, contiguous=True), slots // 16, seed=args.seed)
        out["paged_waste_pct"][name] = round(paged.steady.waste_pct, 2)
        out["paged_waste_pct"][f"{name}_bs8"] = round(paged8.steady.waste_pct, 2)
        out["contiguous_waste_pct"][name] = round(contig.steady.waste_pct, 2)
        out["paged_waste_whole_run_pct"][name] = round(paged.whole.waste_pct, 2)
        out["paged_waste_whole_run_pct"][f"{name}_bs8"] = round(paged8.whole.waste_pct, 2)
        out["contiguous_waste_whole_run_pct"][name] = round(contig.whole.waste_pct, 2)
        out["max_concurrency_paged"][name] = paged.max_concurrency
        out["max_concurrency_contiguous"][name] = contig.max_concurrency
        out["concurrency_ratio"][name] = round(paged.max_concurrency / contig.max_concurrency, 2)
        sp, sc = paged.steady.mean_running, contig.steady.mean_running
        out["sustained_concurrency_paged"][name] = round(sp, 1)
        out["sustained_concurrency_contiguous"][name] = round(sc, 1)
        out["sustained_concurrency_ratio"][name] = round(sp / sc, 2)
        out["preemptions_paged"][name] = paged.preemptions
        share_reqs = reqs[:int(counts[name] * args.sharing_fraction)]
        for key in ("parallel_sampling_saving_pct", "beam_saving_pct",
                    "parallel_sampling_saving_expected_pct",
                    "parallel_sampling_saving_steady_window_pct",
                    "beam_saving_steady_window_pct"):
            out[key][name] = {}
        for k in (2, 4, 6):
            out["parallel_sampling_saving_expected_pct"][name][str(k)] = round(
                expected_parallel_saving(share_reqs, k, 16), 2)
            for kind, kw in (("parallel_sampling", {"n": k}), ("beam", {"beam": k})):
                log(f"{name}: {kind.replace('_', ' ')} {k}")
                f = run(share_reqs, config(16, mml), slots // 16, seed=args.seed, **kw)
                out[f"{kind}_saving_pct"][name][str(k)] = round(f.whole.saving_pct, 2)
                out[f"{kind}_saving_steady_window_pct"][name][str(k)] = round(
                    f.steady.saving_pct, 2)
        log(f"{name}: shared {args.system_prompt}-token system prompt, prefix caching")
        sys_reqs = make_requests(model, counts[name], seed=args.seed, max_len=mml,
                                 system_prompt_len=args.system_prompt)
        f = run(sys_reqs, config(16, mml, prefix_caching=True), slots // 16, seed=args.seed)
        out["prefix_hit_rate"][name] = round(f.prefix_hit_rate, 4)
        log(f"{name}: growth_reserve 0 / 0.5 / 1")
        out["growth_reserve"][name] = {}
        for gr in (0.0, 0.5, 1.0):
            f = run(reqs, replace(config(16, mml), growth_reserve=gr), slots // 16,
                    seed=args.seed)
            out["growth_reserve"][name][str(gr)] = {
                "preemptions": f.preemptions, "steps": f.whole.steps,
                "sustained_concurrency": round(f.steady.mean_running, 1)}
    out["setup"] = {"kv_slots": slots, "max_model_len": mml, "seed": args.seed,
                    "requests": counts,
                    "sharing_requests": {k: int(v * args.sharing_fraction)
                                         for k, v in counts.items()},
                    "system_prompt_tokens": args.system_prompt,
                    "scheduler": asdict(config(16, mml))}
    return out


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def table(res: dict) -> str:
    rows = [("", "ShareGPT-like", "Alpaca-like")]

    def row(label, key, sub=None, fmt="{}"):
        vals = []
        for w in ("sharegpt", "alpaca"):
            v = res[key][w] if sub is None else res[key][w][sub]
            vals.append(fmt.format(v))
        rows.append((label, *vals))

    row("KV waste, paged, block 16 (%)", "paged_waste_pct")
    rows.append(("KV waste, paged, block 8 (%)", str(res["paged_waste_pct"]["sharegpt_bs8"]),
                 str(res["paged_waste_pct"]["alpaca_bs8"])))
    row("KV waste, contiguous (%)", "contiguous_waste_pct")
    row("  whole run incl. drain, paged (%)", "paged_waste_whole_run_pct")
    row("  whole run incl. drain, contiguous (%)", "contiguous_waste_whole_run_pct")
    row("max running requests, paged", "max_concurrency_paged")
    row("max running requests, contiguous", "max_concurrency_contiguous")
    row("max concurrency ratio paged / contiguous", "concurrency_ratio")
    row("sustained running requests, paged", "sustained_concurrency_paged")
    row("sustained running requests, contiguous", "sustained_concurrency_contiguous")
    row("sustained concurrency ratio", "sustained_concurrency_ratio")
    for k in ("2", "4", "6"):
        row(f"parallel sampling n={k}: blocks saved (%)", "parallel_sampling_saving_pct", k)
    for k in ("2", "4", "6"):
        row(f"beam search width {k}: blocks saved (%)", "beam_saving_pct", k)
    for k in ("2", "4", "6"):
        row(f"  n={k}, expected from block arithmetic (%)",
            "parallel_sampling_saving_expected_pct", k)
    for k in ("2", "4", "6"):
        row(f"  steady window only, n={k} (%)", "parallel_sampling_saving_steady_window_pct", k)
    for k in ("2", "4", "6"):
        row(f"  steady window only, width {k} (%)", "beam_saving_steady_window_pct", k)
    row("prefix cache hit rate (256-token system prompt)", "prefix_hit_rate", fmt="{:.1%}")
    for gr in ("0.0", "0.5", "1.0"):
        rows.append((f"growth_reserve {gr}: preemptions / sustained batch",
                     *(f"{res['growth_reserve'][w][gr]['preemptions']} / "
                       f"{res['growth_reserve'][w][gr]['sustained_concurrency']}"
                       for w in ("sharegpt", "alpaca"))))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"| {r[0]:<{w[0]}} | {r[1]:>{w[1]}} | {r[2]:>{w[2]}} |" for r in rows]
    lines.insert(1, f"|{'-' * (w[0] + 2)}|{'-' * (w[1] + 1)}:|{'-' * (w[2] + 1)}:|")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    names = ["sharegpt", "alpaca"]
    labels = ["ShareGPT-like", "Alpaca-like"]
    x = range(len(names))
    ax = axes[0]
    for off, key, lab in ((-0.2, "paged_waste_pct", "paged, block 16"),
                          (0.2, "contiguous_waste_pct", "contiguous (max_model_len reserved)")):
        vals = [res[key][n] for n in names]
        bars = ax.bar([i + off for i in x], vals, 0.4, label=lab)
        ax.bar_label(bars, [f"{v:.1f}" for v in vals], fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylim(0, 110)
    ax.set_ylabel("KV slots allocated but unfilled (%)")
    ax.set_title("KV cache waste (steady state)")
    ax.legend(fontsize=8, loc="upper left")
    ax = axes[1]
    for off, key, lab in ((-0.2, "sustained_concurrency_paged", "paged"),
                          (0.2, "sustained_concurrency_contiguous", "contiguous")):
        vals = [res[key][n] for n in names]
        bars = ax.bar([i + off for i in x], vals, 0.4, label=lab)
        ax.bar_label(bars, [f"{v:.0f}" for v in vals], fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_yscale("log")
    ax.set_ylabel("running requests (steady state)")
    ax.set_title(f"Batch on {res['setup']['kv_slots']} KV slots")
    ax.legend(fontsize=8)
    for ax, kind, key in ((axes[2], "parallel", "parallel_sampling_saving_pct"),
                          (axes[3], "beam", "beam_saving_pct")):
        for n, lab, color in zip(names, labels, ("C0", "C1")):
            ks = [2, 4, 6]
            ax.plot(ks, [res[key][n][str(k)] for k in ks], "o-", color=color, label=lab)
            lo, hi = PAPER_BANDS[kind][n]
            ax.axhspan(lo, hi, color=color, alpha=0.12)
        ax.set_xticks([2, 4, 6])
        ax.set_xlabel("n" if kind == "parallel" else "beam width")
        ax.set_ylabel("blocks saved by sharing (%)")
        ax.set_title(("Parallel sampling" if kind == "parallel" else "Beam search")
                     + " (shaded: paper, 2..6)", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-slots", type=int, default=32768, help="KV budget in token slots")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--sharegpt-requests", type=int, default=600)
    ap.add_argument("--alpaca-requests", type=int, default=4000)
    ap.add_argument("--sharing-fraction", type=float, default=0.6,
                    help="the sharing runs use this fraction of the requests (each holds n seqs)")
    ap.add_argument("--system-prompt", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--plot", help="write the figure to this PNG")
    args = ap.parse_args()
    res = measure(args)
    if args.plot:
        plot(res, args.plot)
    if args.json:
        print(json.dumps(res))
    else:
        print(table(res))


if __name__ == "__main__":
    main()
