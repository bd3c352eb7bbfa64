"""Serving benchmark: Poisson arrivals at several rates, three systems side by side in one run.

  paged       the full stack (`pagedserve serve`), paged KV blocks
  contiguous  the same stack with --contiguous: every request reserves max_model_len slots
              up front, as serving systems did before PagedAttention
  hf          transformers static batching on the same model and prompts (a batch runs to
              its longest request before the next batch starts)

The KV budget mirrors the paper's OPT-13B on A100-40GB setting: room for about 7
contiguous reservations of 2,048 tokens (~15k token slots), so memory, not compute, limits
the batch. The HF baseline gets the same budget: a static batch of 7 max-length requests.

Per system and rate it reports TTFT, TPOT, ITL and end-to-end latency percentiles, the
paper's normalized latency (end-to-end ÷ output tokens), request and token throughput, and
goodput under the stated SLOs; then the sustained rate (highest rate whose mean normalized
latency stays under the SLO) and its ratios. `--write-docs` writes its block of docs/benchmarks.md (the prose around it stays) and
PNG plots.

    python loadtest/bench_serving.py --rates 0.25,0.5,1,2 --requests 40 --json --write-docs
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from loadtest.docgen import commit, machine, write_block  # noqa: E402
from loadtest.workloads import poisson_arrivals, sharegpt_like  # noqa: E402
from services.launcher import Stack, build_parser, free_port, free_ports  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Result:
    arrival: float
    prompt_len: int
    output_len: int
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list = field(default_factory=list)
    ok: bool = False

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(1, self.output_len - 1)

    @property
    def normalized(self) -> float:
        return self.e2e / self.output_len


# ---------------------------------------------------------------- the served systems

async def _one_stream(client, req, t0, res: Result):
    prompt, out_len = req
    await asyncio.sleep(max(0.0, res.arrival - (time.perf_counter() - t0)))
    start = time.perf_counter()
    last = None
    body = {"model": MODEL, "prompt": prompt, "max_tokens": out_len, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return
            if any(c.get("text") for c in ev.get("choices", [])):
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
    res.e2e = (last or time.perf_counter()) - start
    res.ok = last is not None


def _poll_metrics(url: str, stop: threading.Event, trace: list, t0: list) -> None:
    with httpx.Client(timeout=5) as c:
        while not stop.is_set():
            try:
                text = c.get(url + "/metrics").text
                vals = {}
                for line in text.splitlines():
                    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running"):
                        if line.startswith(name + "{"):
                            vals[name] = float(line.rsplit(" ", 1)[1])
                if vals and t0:
                    trace.append((time.perf_counter() - t0[0], vals.get("vllm:kv_cache_usage_perc", 0),
                                  vals.get("vllm:num_requests_running", 0)))
            except httpx.HTTPError:
                pass
            stop.wait(0.25)


def run_stack(mode: str, requests, rates, args) -> dict:
    flags = ["serve", "--port", str(free_port()), "--grpc-port", str(free_port()),
             "--zmq-port", str(free_ports(2)), "--device", args.device, "--dtype", args.dtype,
             "--num-gpu-blocks", str(args.kv_slots // args.block_size),
             "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
             "--max-num-seqs", "256", "--max-num-batched-tokens", str(args.max_batched_tokens),
             "--max-queue", "100000", "--log-level", "warning", "--no-prefix-caching"]
    if mode == "contiguous":
        flags.append("--contiguous")
    out = {}
    # the with block stops the stack on leaving, also on SIGTERM / SIGINT
    with Stack(build_parser().parse_args(flags)) as stack:
        url = stack.start()
        for rate in rates:
            arrivals = _arrivals(len(requests), rate, args.seed)
            results = [Result(a, len(p), o) for a, (p, o) in zip(arrivals, requests)]
            trace, stop, t0 = [], threading.Event(), []
            poller = threading.Thread(target=_poll_metrics, args=(url, stop, trace, t0), daemon=True)
            poller.start()

            async def go():
                async with httpx.AsyncClient(base_url=url, timeout=3600,
                                             limits=httpx.Limits(max_connections=2000)) as c:
                    t0.append(time.perf_counter())
                    await asyncio.gather(*[_one_stream(c, r, t0[0], res)
                                           for r, res in zip(requests, results)])
                    return time.perf_counter() - t0[0]

            wall = asyncio.run(go())
            stop.set()
            poller.join()
            out[rate] = _summarise(results, wall, args)
            out[rate]["trace"] = trace
            print(f"  {mode:10} rate {rate:6.2f}/s: {out[rate]['summary']}", file=sys.stderr)
    return out


# ---------------------------------------------------------------- transformers static batching

def run_hf(requests, rates, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from services.executor.model_loader import ensure_hf_folder
    from shared.model_source import resolve_model

    folder = ensure_hf_folder(resolve_model(MODEL))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    batch = max(1, args.kv_slots // args.max_model_len)     # same KV budget as contiguous
    out = {}
    for rate in rates:
        arrivals = _arrivals(len(requests), rate, args.seed)
        results = [Result(a, len(p), o) for a, (p, o) in zip(arrivals, requests)]
        t0 = time.perf_counter()
        i = 0
        while i < len(requests):
            now = time.perf_counter() - t0
            if arrivals[i] > now:
                time.sleep(arrivals[i] - now)
                now = arrivals[i]
            j = i
            while j < len(requests) and j - i < batch and arrivals[j] <= now:
                j += 1
            group = list(range(i, j))
            _hf_generate(model, [requests[k] for k in group], torch)
            end = time.perf_counter() - t0
            for k in group:
                r = results[k]
                # static batching returns the whole batch at the end; nothing streams
                r.ttft = r.e2e = end - r.arrival
                r.ok = True
            i = j
        out[rate] = _summarise(results, time.perf_counter() - t0, args)
        print(f"  {'hf':10} rate {rate:6.2f}/s: {out[rate]['summary']}", file=sys.stderr)
    return out


def _hf_generate(model, reqs, torch) -> None:
    longest = max(len(p) for p, _ in reqs)
    ids = torch.zeros((len(reqs), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, _) in enumerate(reqs):           # left padding, as generate expects
        ids[row, longest - len(p):] = torch.tensor(p)
        mask[row, longest - len(p):] = 1
    new = max(o for _, o in reqs)
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)


# ---------------------------------------------------------------- figures

def _arrivals(n: int, rate: float, seed: int) -> list[float]:
    return poisson_arrivals(n, rate, seed)


def _pct(xs, q):
    xs = [x for x in xs if not math.isnan(x)]
    return float(np.percentile(xs, q)) if xs else math.nan


def _summarise(results: list[Result], wall: float, args) -> dict:
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl]
    good = [r for r in ok if r.ttft <= args.slo_ttft and r.tpot <= args.slo_tpot]
    d = {
        "completed": len(ok), "failed": len(results) - len(ok), "wall_s": wall,
        "request_throughput": len(ok) / wall,
        "output_token_throughput": sum(r.output_len for r in ok) / wall,
        "goodput_req_s": len(good) / wall,
        "mean_normalized_latency": statistics.fmean(r.normalized for r in ok) if ok else math.inf,
        "normalized": [r.normalized for r in ok], "e2e_all": [r.e2e for r in ok],
    }
    for name, xs in (("ttft", [r.ttft for r in ok]), ("tpot", [r.tpot for r in ok]),
                     ("itl", itl), ("e2e", [r.e2e for r in ok])):
        for q in (50, 90, 99):
            d[f"{name}_p{q}"] = _pct(xs, q)
    d["summary"] = (f"norm {d['mean_normalized_latency']:.3f} s/tok, "
                    f"{d['output_token_throughput']:.1f} tok/s, ttft p50 {d['ttft_p50']:.2f}s")
    return d


def meets_slo_everywhere(by_rate: dict, slo: float) -> bool:
    """Every rate tried stays under the SLO: the sustained rate is then only a lower bound
    (the highest rate tried)."""
    return all(d["mean_normalized_latency"] <= slo for d in by_rate.values())


def slo_sweep(res: dict, slos: list[float]) -> dict:
    """Sustained rates and paged's ratios at several SLOs, each marked when it is a bound:
    {slo: {"rates": {system: r}, "lower_bound": [systems], "ratio_vs_<other>": x}}."""
    out = {}
    for slo in slos:
        rates = {s: sustained_rate(r, slo) for s, r in res.items()}
        entry = {"rates": rates,
                 "lower_bound": [s for s, r in res.items() if meets_slo_everywhere(r, slo)]}
        if "paged" in rates:
            for other in ("contiguous", "hf"):
                if other in rates:
                    entry[f"ratio_vs_{other}"] = (rates["paged"] / rates[other]
                                                  if rates[other] else math.inf)
        out[str(slo)] = entry
    return out


def sustained_rate(by_rate: dict, slo: float) -> float:
    """Highest rate whose mean normalized latency is under the SLO, interpolated linearly
    between the last passing and the first failing rate (the highest rate tried when every
    rate passes: see meets_slo_everywhere)."""
    rates = sorted(by_rate)
    best = 0.0
    for lo, hi in zip([0.0] + rates, rates):
        y = by_rate[hi]["mean_normalized_latency"]
        if y <= slo:
            best = hi
            continue
        y0 = by_rate[lo]["mean_normalized_latency"] if lo in by_rate else 0.0
        if y0 <= slo < y:
            best = lo + (hi - lo) * (slo - y0) / (y - y0)
        break
    return best


def write_docs(res: dict, args, figures: dict, bounded: list[str], sweep: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = ROOT / "docs"
    colours = {"paged": "tab:blue", "contiguous": "tab:orange", "hf": "tab:green"}
    fig, ax = plt.subplots(figsize=(6, 4))
    for system, by_rate in res.items():
        rates = sorted(by_rate)
        ax.plot(rates, [by_rate[r]["mean_normalized_latency"] for r in rates], "o-",
                label=system, color=colours[system])
    ax.axhline(args.slo_normalized, ls="--", color="grey", label="SLO")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(docs / "serving_normalized_latency.png", dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    for system, by_rate in res.items():
        rate = min(by_rate, key=lambda r: abs(r - args.cdf_rate))
        xs = np.sort(by_rate[rate]["e2e_all"])
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=f"{system} @ {rate}/s",
                color=colours[system])
    ax.set_xlabel("end-to-end latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(docs / "serving_latency_cdf.png", dpi=120)

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
    for system in ("paged", "contiguous"):
        by_rate = res.get(system, {})
        if not by_rate:
            continue
        rate = min(by_rate, key=lambda r: abs(r - args.cdf_rate))
        tr = by_rate[rate]["trace"]
        if tr:
            t, kv, run = zip(*tr)
            a1.plot(t, [100 * k for k in kv], label=f"{system} @ {rate}/s", color=colours[system])
            a2.plot(t, run, label=system, color=colours[system])
    a1.set_ylabel("KV blocks in use (%)")
    a2.set_ylabel("running requests")
    a2.set_xlabel("time (s)")
    a1.legend()
    fig.tight_layout()
    fig.savefig(docs / "serving_kv_usage.png", dpi=120)

    lines = [
        "<!-- written by loadtest/bench_serving.py --write-docs; edit the script, not this "
        "block -->",
        "## The run",
        "",
        "Produced by `loadtest/bench_serving.py` (command below); every system ran in the same",
        "invocation on the same machine, model, dtype, prompts and output lengths.",
        "",
        f"    {args.command}",
        "",
        f"- code at commit {commit()}, on {machine(args.device)}",
        f"- model: {MODEL}, dtype {args.dtype}, device {args.device}",
        f"- workload: {args.requests} ShareGPT-like requests (seed {args.seed}), lengths scaled by "
        f"{args.length_scale:g} (prompts ~{161 * args.length_scale:.0f}, outputs "
        f"~{338 * args.length_scale:.0f} tokens on average), Poisson arrivals",
        f"- KV budget: {args.kv_slots} token slots = {args.kv_slots // args.max_model_len} "
        f"contiguous reservations of {args.max_model_len} tokens",
        f"- SLO for the sustained rate: mean normalized latency ≤ {args.slo_normalized} s/token; "
        f"goodput counts requests with TTFT ≤ {args.slo_ttft} s and TPOT ≤ {args.slo_tpot} s",
        "",
        "| system | rate (req/s) | req/s | out tok/s | goodput req/s | norm. latency (s/tok) | "
        "TTFT p50 / p99 (s) | TPOT p50 (s) | ITL p50 / p99 (s) | e2e p50 / p99 (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system, by_rate in res.items():
        for rate in sorted(by_rate):
            d = by_rate[rate]
            lines.append(
                f"| {system} | {rate} | {d['request_throughput']:.3f} | "
                f"{d['output_token_throughput']:.1f} | {d['goodput_req_s']:.3f} | "
                f"{d['mean_normalized_latency']:.3f} | {d['ttft_p50']:.2f} / {d['ttft_p99']:.2f} | "
                f"{d['tpot_p50']:.3f} | {d['itl_p50']:.3f} / {d['itl_p99']:.3f} | "
                f"{d['e2e_p50']:.1f} / {d['e2e_p99']:.1f} |")
    lines += ["", "Sustained rate under the SLO (between the last rate that meets it and the "
              "first that does not, interpolated linearly; below the lowest rate tried, from "
              "the origin, which can only overstate that system's rate):", ""]
    for k, v in figures.items():
        lines.append(f"- `{k}`: {v:.3f}")
    for system in bounded:
        lines.append(f"- {system} met the SLO at every rate tried: its sustained rate is at "
                     "least the highest rate tried, and a ratio over it is a lower bound")
    systems = list(res)
    others = [o for o in ("contiguous", "hf") if o in systems and "paged" in systems]
    lines += ["", "The same run at other SLOs (≥: the system met that SLO at every rate tried):",
              "", "| SLO (s/token) | " + " | ".join(systems) + " | "
              + " | ".join(f"paged / {o}" for o in others) + " |",
              "|---|" + "---|" * (len(systems) + len(others))]
    for slo, e in sweep.items():
        mark = {s: "≥ " if s in e["lower_bound"] else "" for s in systems}
        cells = [f"{mark[s]}{e['rates'][s]:.3f}" for s in systems]
        for o in others:
            x = e[f"ratio_vs_{o}"]
            # a bound on paged makes the ratio a lower bound; one on the other, an upper one
            pre = "≥ " if "paged" in e["lower_bound"] and o not in e["lower_bound"] else (
                "? " if o in e["lower_bound"] else "")
            cells.append(f"{pre}{x:.2f}x")
        lines.append(f"| {slo} | " + " | ".join(cells) + " |")
    lines += ["", "![normalized latency](serving_normalized_latency.png)", "",
              "![latency CDF](serving_latency_cdf.png)", "",
              "![KV usage and batch size](serving_kv_usage.png)", ""]
    write_block(docs / "benchmarks.md", "bench_serving", lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="0.25,0.5,1,2")
    ap.add_argument("--hf-rates", default=None,
                    help="rates for transformers static batching (default: --rates); it "
                         "saturates far below the engine, so its low rates are the useful ones")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--systems", default="paged,contiguous,hf")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-slots", type=int, default=7 * 2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--length-scale", type=float, default=1.0,
                    help="scale ShareGPT-like lengths (a quicker run keeps the shape)")
    ap.add_argument("--slo-normalized", type=float, default=1.0, help="s/token")
    ap.add_argument("--slo-sweep", default="0.1,0.15,0.2,0.25,0.5",
                    help="also report the sustained rates and ratios at these SLOs (s/token)")
    ap.add_argument("--slo-ttft", type=float, default=10.0)
    ap.add_argument("--slo-tpot", type=float, default=0.5)
    ap.add_argument("--cdf-rate", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    args.command = "python loadtest/bench_serving.py " + " ".join(sys.argv[1:])
    rates = [float(r) for r in args.rates.split(",")]
    requests = sharegpt_like(args.requests, seed=args.seed, scale=args.length_scale,
                             max_len=args.max_model_len)
    res = {}
    for system in args.systems.split(","):
        print(f"running {system} ...", file=sys.stderr)
        if system == "hf":
            res[system] = run_hf(requests, [float(r) for r in (args.hf_rates or args.rates)
                                            .split(",")], args)
        else:
            res[system] = run_stack(system, requests, rates, args)
    sustained = {s: sustained_rate(r, args.slo_normalized) for s, r in res.items()}
    figures = {f"sustained_rate_{s}": v for s, v in sustained.items()}
    bounded = [s for s, r in res.items() if meets_slo_everywhere(r, args.slo_normalized)]
    if "paged" in sustained:
        for other in ("contiguous", "hf"):
            if other in sustained:
                figures[f"sustained_rate_ratio_vs_{other}"] = (
                    sustained["paged"] / sustained[other] if sustained[other] else math.inf)
    sweep = slo_sweep(res, [float(x) for x in args.slo_sweep.split(",") if x])
    if args.write_docs:
        write_docs(res, args, figures, bounded, sweep)
    table = {s: {str(r): {k: v for k, v in d.items()
                          if k not in ("trace", "normalized", "e2e_all", "summary")}
                 for r, d in by.items()} for s, by in res.items()}
    if args.json:
        print(json.dumps({**figures, "slo_normalized": args.slo_normalized,
                          "sustained_rate_lower_bound": bounded, "slo_sweep": sweep,
                          "by_system": table}))
    else:
        for k, v in figures.items():
            print(f"{k}: {v:.3f}")


if __name__ == "__main__":
    main()
