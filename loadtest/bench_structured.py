"""What grammar-constrained sampling costs, against unconstrained requests in the same run.

The scheduler core drives the real executor (SmolLM2-135M, in process: no wires, so the
figures are the masking itself). At each batch size, B requests with the same chat prompt
run twice: unconstrained, and with a json_schema response format whose grammar cannot
finish early (an array of at least 64 strings), so both produce exactly --output-tokens
tokens per request. Reported per batch size:

  tok/s            output tokens / wall time, both runs, and the ratio
  sched µs/seq     the scheduler's extra time per constrained sequence per step (building
                   the bitmask in schedule(), advancing the matcher in update())
  exec ms/step     the executor's step time, both runs (the mask is applied in the sampler)

--mask-only times the scheduler's part alone, per constrained sequence per step, on B
matchers of the schema above walking random allowed tokens: the step's masks filled by
llguidance's LLExecutor threads into one buffer, row by row into one buffer (both ways of
grammar.fill_masks), and as one bytes object per row joined; and consuming the tokens.

--sampler-only times the executor's part alone: the Sampler on random [B, 49152] fp32 logits
at temperature 1.0, with every row masked (a random half of the vocabulary allowed) and
without, and the mask's apply alone, best of 20 alternating calls each.

Each pair runs --repeat times, alternating, and the best run of each kind is kept (a
shared machine's noise only ever slows a run down).

    python loadtest/bench_structured.py [--batches 1,16,64] [--output-tokens 32]
                                        [--repeat 2] [--json] [--mask-only | --sampler-only]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.executor.config import ExecutorConfig  # noqa: E402
from services.executor.model_runner import ModelRunner  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from services.scheduler.grammar import Grammars, fill_masks  # noqa: E402
from services.scheduler.scheduler import Scheduler  # noqa: E402
from shared.messages import GenerationRequest, OutputConstraint, SamplingParams  # noqa: E402
from shared.model_source import load_tokenizer, resolve_model  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["notes"],
          "properties": {"notes": {"type": "array", "minItems": 64,
                                   "items": {"type": "string", "maxLength": 40}}}}


GRAMMARS = Grammars()      # one cache for every run: compiled once, as a server holds it


def run(runner: ModelRunner, prompt: list[int], batch: int, tokens: int,
        constraint: OutputConstraint | None) -> dict:
    cfg = SchedulerConfig(block_size=runner.block_size, max_model_len=runner.max_model_len,
                          max_num_seqs=max(batch, 1))
    sched = Scheduler(cfg, runner.num_gpu_blocks, runner.num_cpu_blocks)
    sched.grammars = GRAMMARS
    for i in range(batch):
        sched.add_request(GenerationRequest(f"r{i}", prompt, SamplingParams(
            temperature=1.0, seed=i, max_tokens=tokens, constraint=constraint)))
    sched_s = exec_s = 0.0
    steps = generated = 0
    start = time.perf_counter()
    while sched.has_unfinished():
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        result = runner.execute(plan)
        t2 = time.perf_counter()
        outs = sched.update(plan, result).request_outputs()
        t3 = time.perf_counter()
        assert result.error is None, result.error
        generated += sum(len(d.token_ids) for o in outs for d in o.seqs)
        if plan.num_sampling_rows == batch:          # decode steps: every sequence samples
            sched_s += (t1 - t0) + (t3 - t2)
            exec_s += t2 - t1
            steps += 1
    wall = time.perf_counter() - start
    return {"tok_s": generated / wall, "generated": generated, "decode_steps": steps,
            "sched_us_per_step": 1e6 * sched_s / max(steps, 1),
            "exec_ms_per_step": 1e3 * exec_s / max(steps, 1)}


def sampler_cost(batches: list[int], vocab: int = 49152, calls: int = 20) -> list[dict]:
    import torch

    from services.executor.sampler import Sampler, SampleRow, TokenMask

    sampler = Sampler(0)
    rows_out = []
    for b in batches:
        logits = torch.randn(b, vocab)
        rows = [SampleRow(SamplingParams(temperature=1.0), [1, 2, 3], 3) for _ in range(b)]
        words = -(-vocab // 32)
        bits = torch.randint(-2**31, 2**31 - 1, (b, words), dtype=torch.int32)
        mask = TokenMask(list(range(b)), words, bits.numpy().tobytes())
        best = {"free": float("inf"), "masked": float("inf"), "apply": float("inf")}
        for _ in range(calls):
            for kind, fn in (("free", lambda: sampler(logits, rows, None)),
                             ("masked", lambda: sampler(logits, rows, mask)),
                             ("apply", lambda: mask.apply(logits))):
                t = time.perf_counter()
                fn()
                best[kind] = min(best[kind], time.perf_counter() - t)
        rows_out.append({"batch": b, "free_ms": 1e3 * best["free"],
                         "masked_ms": 1e3 * best["masked"], "apply_ms": 1e3 * best["apply"],
                         "ratio": best["masked"] / best["free"]})
    return rows_out


def mask_cost(batches: list[int], steps: int = 48) -> list[dict]:
    """µs per constrained sequence per step of each way to fill a step's masks, and of
    consuming the sampled tokens. Each way has its own matchers, fed the same tokens; the
    order of the ways rotates each step (the first to reach a new grammar state pays for
    the lexer states that all copies then share)."""
    import random
    from types import SimpleNamespace

    from services.scheduler import grammar

    template = GRAMMARS.compile(OutputConstraint("json_schema", json.dumps(SCHEMA)))
    group = SimpleNamespace(stop_ids=frozenset({2}))

    def fill(rows: int, cores: int):
        def go(seqs):
            saved = grammar.PARALLEL_MIN_ROWS, grammar._CORES
            grammar.PARALLEL_MIN_ROWS, grammar._CORES = rows, cores
            try:
                return fill_masks(seqs)
            finally:
                grammar.PARALLEL_MIN_ROWS, grammar._CORES = saved
        return go

    def per_row_bytes(seqs):               # a bytes object per row, joined
        w = grammar._mask_bytes
        return b"".join(bytes(s.matcher.compute_bitmask())[:w] for s in seqs)

    ways = {"llexecutor": fill(0, 1 << 30), "per_row_ptr": fill(1 << 30, 1),
            "per_row_bytes": per_row_bytes}
    rng = random.Random(0)
    out = []
    for b in batches:
        seqs = {k: [SimpleNamespace(matcher=template.deep_copy(), group=group)
                    for _ in range(b)] for k in ways}
        spent = dict.fromkeys([*ways, "consume"], 0.0)
        for step in range(steps):
            order = list(ways)[step % len(ways):] + list(ways)[:step % len(ways)]
            for k in order:
                t = time.perf_counter()
                masks = ways[k](seqs[k])
                spent[k] += time.perf_counter() - t
            width = len(masks) // b
            for k in range(b):
                row = masks[k * width:(k + 1) * width]
                allowed = [8 * i + j for i, byte in enumerate(row) if byte
                           for j in range(8) if byte >> j & 1 and 8 * i + j != 2]
                tok = rng.choice(allowed)
                for way, ss in seqs.items():
                    t = time.perf_counter()
                    assert ss[k].matcher.consume_token(tok)
                    if way == "llexecutor":
                        spent["consume"] += time.perf_counter() - t
        out.append({"batch": b, **{k: 1e6 * v / (steps * b) for k, v in spent.items()}})
    return out


def _table(rows: list[dict], as_json: bool, cols: list[tuple[str, str]]) -> None:
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'batch':>5} " + " ".join(f"{h:>{len(h)}}" for h, _ in cols))
    for r in rows:
        print(f"{r['batch']:>5} " + " ".join(f"{r[k]:>{len(h)}.2f}" for h, k in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="executor CPU threads (0: all)")
    ap.add_argument("--sampler-only", action="store_true")
    ap.add_argument("--mask-only", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    if args.sampler_only:
        _table(sampler_cost(batches), args.json, [
            ("sampler ms free", "free_ms"), ("sampler ms masked", "masked_ms"),
            ("ratio", "ratio"), ("mask apply ms", "apply_ms")])
        return
    if args.mask_only:       # µs per constrained sequence per step
        _table(mask_cost(batches), args.json, [
            ("llexecutor µs", "llexecutor"), ("per-row ptr µs", "per_row_ptr"),
            ("per-row bytes µs", "per_row_bytes"), ("consume µs", "consume")])
        return
    tok = load_tokenizer(resolve_model(None))
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Write notes about Paris as JSON."}], tokenize=False,
        add_generation_prompt=True), add_special_tokens=False)
    runner = ModelRunner(ExecutorConfig(device="cpu", dtype="float32", max_model_len=512,
                                        num_gpu_blocks=2048, swap_space_gib=0.01,
                                        num_threads=args.threads))
    schema = OutputConstraint("json_schema", json.dumps(SCHEMA))
    run(runner, prompt, 1, 4, schema)                # warm-up: kernels, tokenizer, grammar
    rows = []
    for b in batches:
        frees, conss = [], []
        for _ in range(args.repeat):
            frees.append(run(runner, prompt, b, args.output_tokens, None))
            conss.append(run(runner, prompt, b, args.output_tokens, schema))
        free = max(frees, key=lambda r: r["tok_s"])
        cons = max(conss, key=lambda r: r["tok_s"])
        assert cons["generated"] == free["generated"] == b * args.output_tokens
        rows.append({"batch": b, "free": free, "constrained": cons,
                     "ratio": cons["tok_s"] / free["tok_s"],
                     "mask_us_per_seq": (cons["sched_us_per_step"]
                                         - free["sched_us_per_step"]) / b})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'batch':>5} {'free tok/s':>10} {'json tok/s':>10} {'ratio':>6} "
          f"{'sched µs/seq/step':>18} {'exec ms/step free':>17} {'exec ms/step json':>17}")
    for r in rows:
        print(f"{r['batch']:>5} {r['free']['tok_s']:>10.1f} {r['constrained']['tok_s']:>10.1f} "
              f"{r['ratio']:>6.2f} {r['mask_us_per_seq']:>18.1f} "
              f"{r['free']['exec_ms_per_step']:>17.1f} "
              f"{r['constrained']['exec_ms_per_step']:>17.1f}")


if __name__ == "__main__":
    main()
