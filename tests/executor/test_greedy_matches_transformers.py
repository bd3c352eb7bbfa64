"""Greedy SmolLM2 through ModelRunner equals transformers, token for token, logit for logit.

Each test drives the runner with hand-built StepPlans (tests/executor/plans.py): a small
token budget splits the prompts into prefill chunks that share steps with other
sequences' decodes. The swap and recompute tests force a preemption mid-generation.

Checks per prompt and per generated token t:
  * logits: max |runner - transformers| < 1e-3, against transformers' logits for the same
    prefix (one teacher-forced forward over prompt + the runner's tokens);
  * tokens: each one is the argmax of transformers' logits after the same prefix, which
    makes the whole output transformers' greedy decoding of the prompt, token for token
    (by induction over t: greedy `generate` takes exactly that argmax at every step). A
    token other than the argmax is accepted only where the reference's top-2 logit gap is
    below 1e-4 (a tie that rounding may break either way); the gap is checked explicitly.
"""
from __future__ import annotations

import torch

from shared.messages import SamplingParams
from tests.executor.conftest import NEW_TOKENS
from tests.executor.plans import PlanBuilder

LOGIT_TOL = 1e-3
TIE_GAP = 1e-4
BUDGET = 64          # tokens per step: prompts (~30-60 tokens) need chunks beside decodes


def _generate(runner, prompts, on_step=None) -> tuple[PlanBuilder, dict[int, list[torch.Tensor]]]:
    """Run every prompt to NEW_TOKENS greedy tokens; return the builder and per-seq logits."""
    b = PlanBuilder(runner.num_gpu_blocks, runner.num_cpu_blocks, runner.block_size, BUDGET)
    for i, p in enumerate(prompts):
        b.add(i, p, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), NEW_TOKENS)
    logits: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    runner.keep_logits = True
    mixed_steps = 0
    try:
        while not b.done:
            assert b.step_id < 2000, "generation did not finish: the plan builder is stuck"
            if on_step is not None:
                on_step(b)
            plan = b.next_plan()
            n = plan.num_tokens
            mixed_steps += 1 in n and any(x > 1 for x in n)
            result = runner.execute(plan)
            b.apply(result)
            for sid, row in runner.last_logits.items():
                logits[sid].append(row)
            runner.last_logits = {}
        runner.execute(b.next_plan())    # carries the last finished ids: drop all state
    finally:
        runner.keep_logits = False
    assert not runner.seqs, "every finished sequence must be dropped by the executor"
    assert mixed_steps > 0, "the budget must mix decodes with prefill chunks"
    return b, logits


def _check_against_transformers(b: PlanBuilder, logits, hf_model, runner) -> None:
    # One right-padded teacher-forced forward: row t of seq i = logits after its prefix t.
    seqs = [b.seqs[i] for i in range(len(b.seqs))]
    full = [s.prompt + s.outputs[:-1] for s in seqs]
    width = max(map(len, full))
    ids = torch.tensor([f + [0] * (width - len(f)) for f in full])
    mask = torch.tensor([[1] * len(f) + [0] * (width - len(f)) for f in full])
    with torch.inference_mode():
        ref_all = hf_model(ids, attention_mask=mask).logits.float()
    errs = {}
    for sid, seq in enumerate(seqs):
        assert len(seq.outputs) == NEW_TOKENS and len(logits[sid]) == NEW_TOKENS
        ref = ref_all[sid, seq.prompt_len - 1:seq.prompt_len - 1 + NEW_TOKENS]
        errs[sid] = (torch.stack(logits[sid]) - ref).abs().amax(dim=-1)
    if max(float(e.max()) for e in errs.values()) >= LOGIT_TOL:
        # An intermittent failure of this kind was seen twice (session 4, Intel with AMX,
        # fresh GGUF conversion in the same process) and never reproduced: say everything
        # that could tell its cause.
        mkldnn = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", "?")
        per_prompt = ", ".join(f"{sid}: {float(e.max()):.1e} at step {int(e.argmax())}"
                               for sid, e in errs.items())
        # Is it the padded reference or the runner? The worst prompt alone, unpadded.
        worst = max(errs, key=lambda sid: float(errs[sid].max()))
        seq = seqs[worst]
        rows = slice(seq.prompt_len - 1, seq.prompt_len - 1 + NEW_TOKENS)
        with torch.inference_mode():
            alone = hf_model(torch.tensor([full[worst]])).logits.float()[0, rows]
        raise AssertionError(
            f"logits differ from transformers by >= {LOGIT_TOL} (max per prompt: {per_prompt}); "
            f"prompt {worst} alone: the padded reference is "
            f"{float((alone - ref_all[worst, rows]).abs().max()):.1e} from it, the runner "
            f"{float((torch.stack(logits[worst]) - alone).abs().max()):.1e}; "
            f"fp32 GEMM {runner.model.layers[0].qkv.gemm}, {torch.get_num_threads()} threads, "
            f"float32 matmul precision {torch.get_float32_matmul_precision()}, "
            f"mkldnn fp32 precision {mkldnn}")
    for sid, seq in enumerate(seqs):
        out = seq.outputs
        ref = ref_all[sid, seq.prompt_len - 1:seq.prompt_len - 1 + NEW_TOKENS]
        top2 = ref.topk(2, dim=-1).values
        gap = top2[:, 0] - top2[:, 1]
        for t in range(NEW_TOKENS):
            if out[t] != int(ref[t].argmax()):
                assert gap[t] < TIE_GAP, f"prompt {sid} step {t}: not greedy, gap {gap[t]}"


def test_greedy_continuous_batching_matches_transformers(runner, chat_prompts, hf_model):
    b, logits = _generate(runner, chat_prompts)
    _check_against_transformers(b, logits, hf_model, runner)


def test_greedy_survives_swap_out_and_in(runner, chat_prompts, hf_model):
    victims = list(range(0, len(chat_prompts), 2))
    old_tables: dict[int, list[int]] = {}
    new_tables: dict[int, list[int]] = {}
    swapped_at = []

    def preempt(b: PlanBuilder) -> None:
        # Once the first seqs are decoding, swap out every even seq that is running
        # (mid-prefill or mid-decode), keep it out for two steps, then swap it back in.
        if not old_tables and any(len(s.outputs) >= 8 for s in b.seqs.values()):
            for sid in victims:
                if b.seqs[sid].state == "running":
                    old_tables[sid] = list(b.seqs[sid].table)
                    b.swap_out(sid)
            if old_tables:
                swapped_at.append(b.step_id)
        elif old_tables and not new_tables and b.step_id >= swapped_at[0] + 2:
            for sid in old_tables:
                new_tables[sid] = b.swap_in(sid)

    b, logits = _generate(runner, chat_prompts, preempt)
    assert len(old_tables) >= 4 and new_tables.keys() == old_tables.keys()
    for sid in old_tables:
        assert set(new_tables[sid]).isdisjoint(old_tables[sid]), "swap-in must move blocks"
    _check_against_transformers(b, logits, hf_model, runner)


def test_greedy_survives_recompute(runner, chat_prompts, hf_model):
    dropped: list[int] = []

    def preempt(b: PlanBuilder) -> None:
        if not dropped and sum(len(s.outputs) >= 16 for s in b.seqs.values()) >= 4:
            for sid, s in b.seqs.items():
                if s.state == "running" and s.outputs and len(dropped) < 6:
                    dropped.append(sid)
                    b.recompute(sid)

    b, logits = _generate(runner, chat_prompts, preempt)
    assert len(dropped) >= 4
    _check_against_transformers(b, logits, hf_model, runner)
