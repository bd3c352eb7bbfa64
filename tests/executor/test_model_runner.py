"""ModelRunner's handling of the plan contract: per-seq state, block-table diffs, cache ops,
prompt logprobs, and errors that come back in the StepResult."""
from __future__ import annotations

import json

import pytest
import torch

from shared.messages import NewSeq, SamplingParams, StepPlan
from shared.wire import decode, encode
from tests.executor.conftest import tiny_runner
from tests.executor.plans import Row, step_plan
from tests.executor.test_loader import hf_logits, teacher_forced_logits

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [5, 17, 33, 101, 7, 64, 9, 250, 3, 44, 12]      # 11 tokens: 3 blocks of 4


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    folder, hf = tiny_llama
    return tiny_runner(folder), hf


def _generate(r, steps, seq_id=1, table=(0, 1, 2, 3, 4, 5), params=GREEDY, prompt=PROMPT):
    """Greedy tokens of one seq run alone: prefill, then `steps - 1` decodes."""
    res = r.execute(step_plan(0, [NewSeq(seq_id, "r", prompt, len(prompt), list(table), params)],
                             [Row(seq_id, 0, len(prompt))]))
    out = [res.token_ids[0]]
    for i in range(steps - 1):
        res = r.execute(step_plan(i + 1, rows=[
            Row(seq_id, len(prompt) + i, 1, [out[-1]])]))
        assert res.error is None, res.error
        out.append(res.token_ids[0])
    r.execute(StepPlan(99, finished_seq_ids=[seq_id]))
    return out


def test_prefill_chunk_short_of_the_end_does_not_sample(tiny):
    r, _ = tiny
    res = r.execute(step_plan(0, [NewSeq(1, "r", PROMPT, len(PROMPT), [0, 1, 2], GREEDY)],
                              [Row(1, 0, 6)], sampling=0))
    assert res.error is None and res.token_ids == [] and res.logprobs == []
    res = r.execute(step_plan(1, rows=[Row(1, 6, 5)]))
    assert res.token_ids[0] >= 0
    r.execute(StepPlan(2, finished_seq_ids=[1]))


def test_finished_seq_ids_drop_executor_state(tiny):
    r, _ = tiny
    _generate(r, 2)
    assert 1 not in r.seqs
    res = r.execute(step_plan(5, rows=[Row(1, 11, 1, [3])]))
    assert res.error is not None and "unknown" in res.error and "NewSeq" in res.error


def test_block_diff_copy_on_write_keeps_the_output(tiny):
    """Fork after the prompt: the child keeps the parent's blocks except the last, partly
    filled one, which the plan copies (copy op) before the child writes into it."""
    r, _ = tiny
    alone = _generate(r, 6, table=range(6))
    res = r.execute(step_plan(0, [NewSeq(1, "r", PROMPT, len(PROMPT), [0, 1, 2], GREEDY)],
                             [Row(1, 0, len(PROMPT))]))
    first = res.token_ids[0]
    # child seq 2 shares blocks 0, 1, 2; block 2 holds 3 tokens and is copied to block 9
    fork = NewSeq(2, "r", PROMPT + [first], len(PROMPT), [0, 1, 2], GREEDY)
    res = r.execute(step_plan(1, [fork], [
        Row(1, 11, 1, [first], block_append=[3]),
        Row(2, 11, 1, [], block_keep=2, block_append=[9])], copy=[[2, 9]]))
    assert r.seqs[2].block_table == [0, 1, 9] and r.seqs[1].block_table == [0, 1, 2, 3]
    assert res.token_ids[0] == res.token_ids[1] == alone[1]
    r.execute(StepPlan(2, finished_seq_ids=[1, 2]))


def test_swap_out_and_in_moves_the_blocks(tiny):
    r, _ = tiny
    alone = _generate(r, 5)
    res = r.execute(step_plan(0, [NewSeq(1, "r", PROMPT, len(PROMPT), [0, 1, 2], GREEDY)],
                             [Row(1, 0, len(PROMPT))]))
    out = [res.token_ids[0]]
    saved = r.kv.gpu[:, :, [0, 1, 2]].clone()
    r.execute(StepPlan(1, swap_out=[[0, 5], [1, 6], [2, 7]]))
    r.kv.gpu[:, :, [0, 1, 2]] = 0.0                   # another seq reuses the blocks
    res = r.execute(step_plan(2, rows=[Row(1, 11, 1, [out[-1]], block_keep=0,
                                                        block_append=[20, 21, 22, 23])],
                             swap_in=[[5, 20], [6, 21], [7, 22]]))
    assert r.seqs[1].block_table == [20, 21, 22, 23]
    assert torch.equal(r.kv.gpu[:, :, [20, 21]], saved[:, :, :2])
    assert torch.equal(r.kv.gpu[:, :, 22, :3], saved[:, :, 2, :3])   # slot 3: this step's token
    out.append(res.token_ids[0])
    for i in range(3):
        res = r.execute(step_plan(3 + i, rows=[Row(1, 12 + i, 1, [out[-1]])]))
        out.append(res.token_ids[0])
    r.execute(StepPlan(9, finished_seq_ids=[1]))
    assert out == alone


def test_recompute_as_new_seq_with_outputs_continues_identically(tiny):
    r, _ = tiny
    alone = _generate(r, 6)
    head = _generate(r, 3)
    # the seq was dropped; it comes back with prompt + its 3 outputs, on other blocks
    resumed = PROMPT + head
    res = r.execute(step_plan(0, [NewSeq(1, "r", resumed, len(PROMPT), [10, 11, 12, 13], GREEDY)],
                             [Row(1, 0, len(resumed))]))
    out = head + [res.token_ids[0]]
    for i in range(2):
        res = r.execute(step_plan(1 + i, rows=[
            Row(1, len(resumed) + i, 1, [out[-1]])]))
        out.append(res.token_ids[0])
    r.execute(StepPlan(9, finished_seq_ids=[1]))
    assert out == alone


def test_prompt_logprobs_cover_each_position_once_across_chunks(tiny):
    r, hf = tiny
    params = SamplingParams(temperature=0.0, prompt_logprobs=2)
    got = []
    res = r.execute(step_plan(0, [NewSeq(1, "r", PROMPT, len(PROMPT), [0, 1, 2], params)],
                             [Row(1, 0, 4)], sampling=0))
    got.append(res.prompt_logprobs[0])
    for step, (c, n) in enumerate([(4, 1), (5, 5), (10, 1)], start=1):
        res = r.execute(step_plan(step, rows=[Row(1, c, n)], sampling=int(c + n == 11)))
        got.append(res.prompt_logprobs[0])
    r.execute(StepPlan(9, finished_seq_ids=[1]))
    # positions computed per chunk: 0-3 (0 has none), 4, 5-9, 10
    assert [len(g) for g in got] == [3, 1, 5, 1]
    flat = [lp for g in got for lp in g]
    assert [lp.token_id for lp in flat] == PROMPT[1:]
    ref = torch.log_softmax(hf_logits(hf, PROMPT, 1)[:-1], -1)     # rows 0..9 -> positions 1..10
    for pos, lp in enumerate(flat, start=1):
        assert abs(lp.logprob - float(ref[pos - 1, PROMPT[pos]])) < 1e-4
        assert [t for t, _ in lp.top] == ref[pos - 1].topk(2).indices.tolist()


def test_n_samples_differ_by_sample_index_and_seeds_reproduce(tiny):
    r, _ = tiny
    params = SamplingParams(temperature=1.0, seed=11)

    def run(indices, extra=()):
        seqs = [NewSeq(i + 1, "r", PROMPT, len(PROMPT), [4 * i, 4 * i + 1, 4 * i + 2], params, ix)
                for i, ix in enumerate(indices)]
        seqs += [NewSeq(50 + j, "o", p, len(p), [40 + j], SamplingParams(temperature=1.0))
                 for j, p in enumerate(extra)]
        plan = step_plan(0, seqs, [Row(s.seq_id, 0, len(s.token_ids)) for s in seqs])
        res = r.execute(plan)
        toks = dict(zip(plan.seq_ids, res.token_ids))
        r.execute(StepPlan(1, finished_seq_ids=list(toks)))
        return [toks[i + 1] for i in range(len(indices))]

    draws = run(range(8))
    assert len(set(draws)) > 1, "sample_index must change the draw"
    assert run([3]) == [draws[3]]                           # alone
    assert run([3], extra=[[1, 2, 3], [9, 8]]) == [draws[3]]  # beside other requests


def test_beam_width_returns_two_candidates_per_beam(tiny):
    r, _ = tiny
    params = SamplingParams(temperature=0.0, beam_width=4, logprobs=1)
    res = r.execute(step_plan(0, [NewSeq(1, "r", PROMPT, len(PROMPT), [0, 1, 2], params)],
                             [Row(1, 0, len(PROMPT))]))
    r.execute(StepPlan(1, finished_seq_ids=[1]))
    top = res.top[0]
    assert len(top) == 8 and top[0][0] == res.token_ids[0]
    assert abs(top[0][1] - res.logprobs[0]) < 1e-6


def test_bad_plans_come_back_as_errors_and_the_runner_keeps_working(tiny):
    r, _ = tiny
    short = r.execute(step_plan(0, [NewSeq(1, "r", PROMPT, len(PROMPT), [0], GREEDY)],
                               [Row(1, 0, len(PROMPT))]))
    assert "1 blocks cannot hold 11 tokens" in short.error
    outside = r.execute(step_plan(1, [NewSeq(2, "r", PROMPT, len(PROMPT), [0, 1, 10_000], GREEDY)]))
    assert "outside the pool" in outside.error
    beyond = r.execute(step_plan(2, rows=[Row(1, 0, 99)]))
    assert "not within its 11 tokens" in beyond.error
    twice = r.execute(step_plan(2, rows=[Row(1, 0, 3), Row(1, 3, 3)]))
    assert "scheduled twice" in twice.error
    r.execute(StepPlan(3, finished_seq_ids=[1, 2]))
    misnumbered = r.execute(step_plan(4, [NewSeq(3, "r", PROMPT, len(PROMPT), [0, 1, 2], GREEDY)],
                                      [Row(3, 0, len(PROMPT))], sampling=0))
    assert "num_sampling_rows" in misnumbered.error    # the row reaches its end: it samples
    uneven = StepPlan(5, seq_ids=[3], num_computed_tokens=[0], num_tokens=[], num_sampling_rows=1)
    assert "columns differ" in r.execute(uneven).error
    miscounted = StepPlan(5, seq_ids=[3], num_computed_tokens=[0], num_tokens=[1],
                          num_append_tokens=[1], append_token_ids=[7, 8], block_keep=[-1],
                          block_append=[[]], num_sampling_rows=1)
    assert "appended tokens" in r.execute(miscounted).error
    r.execute(StepPlan(6, finished_seq_ids=[3]))
    assert "Traceback" not in short.error + outside.error + beyond.error
    assert len(_generate(r, 2)) == 2


def test_step_result_survives_the_wire(tiny):
    r, _ = tiny
    params = SamplingParams(temperature=0.0, logprobs=2, prompt_logprobs=1)
    plan = step_plan(0, [NewSeq(1, "r", PROMPT, len(PROMPT), [0, 1, 2], params)],
                    [Row(1, 0, len(PROMPT))])
    res = r.execute(decode(encode(plan)))
    r.execute(StepPlan(1, finished_seq_ids=[1]))
    assert decode(encode(res)) == res
    assert res.forward_ms > 0 and len(res.prompt_logprobs[0]) == len(PROMPT) - 1


def test_runner_matches_transformers_on_a_batch_of_mixed_work(tiny):
    """Two seqs decode while a third prefills in the same step: each row's logits equal
    transformers' logits for that seq alone."""
    r, hf = tiny
    a = teacher_forced_logits(r, PROMPT + [8, 8, 1], len(PROMPT), chunk=11)
    assert (a - hf_logits(hf, PROMPT + [8, 8, 1], len(PROMPT))).abs().max() < 1e-4
    r.keep_logits = True
    p2 = [9, 9, 4, 120, 3]
    r.execute(step_plan(0, [NewSeq(1, "a", PROMPT, 11, [0, 1, 2], GREEDY),
                           NewSeq(2, "b", p2, 5, [3, 4], GREEDY)],
                       [Row(1, 0, 11), Row(2, 0, 5)]))
    res = r.execute(step_plan(1, [NewSeq(3, "c", PROMPT[:7], 7, [5, 6], GREEDY)],
                             [Row(1, 11, 1, [8], block_append=[7]),
                              Row(3, 0, 7), Row(2, 5, 1, [8])]))
    # A one-token row after a chunk runs as a chunk of one; every row answers in plan order.
    assert len(res.token_ids) == 3 and res.token_ids[0] == r.last_logits[1].argmax().item()
    logits = r.last_logits
    r.keep_logits = False
    r.execute(StepPlan(2, finished_seq_ids=[1, 2, 3]))
    assert (logits[1] - hf_logits(hf, PROMPT + [8], 12)[0]).abs().max() < 1e-4
    assert (logits[2] - hf_logits(hf, p2 + [8], 6)[0]).abs().max() < 1e-4
    assert (logits[3] - hf_logits(hf, PROMPT[:7], 7)[0]).abs().max() < 1e-4


def test_torch_ops_path_matches_transformers_too(tiny_llama, monkeypatch):
    """Without the C kernels (no compiler, or PAGEDSERVE_CPU_KERNELS=torch) the torch ops
    path gives the same logits."""
    from services.executor import cpu_kernels

    folder, hf = tiny_llama
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    r = tiny_runner(folder)
    assert not r.model.fused
    tokens = PROMPT + [8, 8, 1, 77]
    got = teacher_forced_logits(r, tokens, len(PROMPT), chunk=5)
    assert (got - hf_logits(hf, tokens, len(PROMPT))).abs().max() < 1e-4


@pytest.mark.parametrize("gemm", ["engine", "mkl", "onednn"])
def test_each_packed_fp32_gemm_matches_transformers(tiny_llama, monkeypatch, gemm):
    """fp32 weights are packed for the engine's own GEMM, MKL or oneDNN, whichever is
    fastest on this CPU: each gives transformers' logits (PAGEDSERVE_CPU_GEMM forces one).
    Only a GEMM this machine lacks is skipped; one that is there and wrong fails."""
    from services.executor import cpu_gemm

    if not cpu_gemm.gemm_available(gemm):
        pytest.skip(f"no packed fp32 {gemm} GEMM here (torch build or CPU)")
    assert cpu_gemm.gemm_correct(gemm), f"the packed fp32 {gemm} GEMM gives wrong products"
    monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", gemm)
    folder, hf = tiny_llama
    r = tiny_runner(folder)
    lins = r.model.linears()
    assert r.packed_weights and all(lin.packed is not None for lin in lins)
    assert all(lin.gemm == gemm for lin in lins)
    tokens = PROMPT + [8, 8, 1, 77]
    got = teacher_forced_logits(r, tokens, len(PROMPT), chunk=5)
    assert (got - hf_logits(hf, tokens, len(PROMPT))).abs().max() < 1e-4


def test_bf16_runner_stays_close_to_fp32(tiny_llama):
    folder, hf = tiny_llama
    r = tiny_runner(folder, dtype="bfloat16")
    assert r.dtype == torch.bfloat16 and r.kv.gpu.dtype == torch.bfloat16
    tokens = PROMPT + [8, 8, 1, 77]
    got = teacher_forced_logits(r, tokens, len(PROMPT), chunk=5)
    ref = hf_logits(hf, tokens, len(PROMPT))
    # bf16 keeps ~3 significant digits: close to fp32, but clearly not identical
    scale = ref.abs().max()
    assert 0 < (got - ref).abs().max() < 0.05 * scale


@pytest.mark.parametrize("gemm", ["engine", "onednn"])
def test_each_packed_bf16_gemm_stays_close_to_fp32(tiny_llama, monkeypatch, gemm):
    """A bf16 model's weights are packed for oneDNN where the CPU multiplies bf16 itself, else
    for the engine's own GEMM (bf16 weights, fp32 sums): each gives logits within bf16
    rounding of transformers' fp32 ones (PAGEDSERVE_CPU_GEMM forces one)."""
    from services.executor import cpu_gemm, cpu_kernels

    if gemm == "engine" and not cpu_kernels.linear_available():
        pytest.skip("no engine GEMM here (C compiler, AVX2 or AVX-512)")
    if gemm == "onednn" and not cpu_gemm.bf16_packing():
        pytest.skip("this torch build / CPU does not pack bf16 for oneDNN")
    monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", gemm)
    folder, hf = tiny_llama
    r = tiny_runner(folder, dtype="bfloat16")
    lins = r.model.linears()
    assert r.packed_weights and all(lin.gemm == gemm for lin in lins)
    if gemm == "engine":       # k-pairs for the bf16 dot products where the CPU has them
        form = torch.int32 if cpu_kernels.dp_available() else torch.bfloat16
        assert all(lin.packed.dtype == form for lin in lins)
    tokens = PROMPT + [8, 8, 1, 77]
    got = teacher_forced_logits(r, tokens, len(PROMPT), chunk=5)
    ref = hf_logits(hf, tokens, len(PROMPT))
    assert 0 < (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_bf16_without_bf16_instructions_takes_the_engine_gemm(monkeypatch):
    """On a CPU without bf16 instructions (AVX2: Zen 2/3) the bf16 model runs on the engine's
    GEMM, not torch's plain bf16 GEMM (a fifth of the fp32 rate there); with them, where
    the engine's GEMM has no bf16 dot products, oneDNN."""
    from services.executor import cpu_gemm, cpu_kernels

    if not cpu_kernels.linear_available():
        pytest.skip("no engine GEMM here (C compiler, AVX2 or AVX-512)")
    monkeypatch.delenv("PAGEDSERVE_CPU_GEMM", raising=False)
    monkeypatch.setattr(cpu_gemm, "cpu_bf16", lambda: ("AuthenticAMD", None))
    assert cpu_gemm.bf16_gemm() == "engine"
    monkeypatch.setattr(cpu_gemm, "cpu_bf16", lambda: ("AuthenticAMD", "avx512_bf16"))
    monkeypatch.setattr(cpu_gemm, "bf16_packing", lambda: True)
    monkeypatch.setattr(cpu_kernels, "dp_available", lambda: False)
    assert cpu_gemm.bf16_gemm([torch.ones(64, 32, dtype=torch.bfloat16)]) == "onednn"


@pytest.mark.parametrize("faster", ["engine", "onednn"])
def test_bf16_with_dot_products_in_both_takes_the_faster(monkeypatch, tmp_path, faster):
    """Where oneDNN and the engine's GEMM both multiply bf16 with the CPU's instructions,
    the one that times faster over the first layer's weights is used (and only there is anything
    timed); PAGEDSERVE_CPU_GEMM still forces one."""
    from services.executor import cpu_gemm, cpu_kernels

    cpu_kernels.kernels()
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))     # no choice remembered
    monkeypatch.delenv("PAGEDSERVE_CPU_GEMM", raising=False)
    monkeypatch.setattr(cpu_gemm, "cpu_bf16", lambda: ("AuthenticAMD", "avx512_bf16"))
    monkeypatch.setattr(cpu_gemm, "bf16_packing", lambda: True)
    monkeypatch.setattr(cpu_kernels, "linear_available", lambda: True)
    monkeypatch.setattr(cpu_kernels, "dp_available", lambda: True)
    timed = []

    def cost(gemm, w, evict):
        timed.append((gemm, w.dtype))
        return 1.0 if gemm == faster else 2.0
    monkeypatch.setattr(cpu_gemm, "time_packed_gemm", cost)
    first_layer = [torch.ones(64, 32, dtype=torch.bfloat16),
                   torch.ones(32, 96, dtype=torch.bfloat16)]
    assert cpu_gemm.bf16_gemm(first_layer) == faster
    assert sorted(timed) == [("engine", torch.bfloat16)] * 2 + [("onednn", torch.bfloat16)] * 2
    monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", "onednn" if faster == "engine" else "engine")
    timed.clear()
    assert cpu_gemm.bf16_gemm(first_layer) != faster and not timed


@pytest.mark.parametrize("engine_cost,picked", [(1.04, "engine"), (1.06, "onednn"),
                                                (0.9, "engine")])
def test_the_fp32_pick_keeps_the_engine_unless_another_is_clearly_faster(
        monkeypatch, tmp_path, engine_cost, picked):
    """Within ENGINE_MARGIN (5 %) of the fastest time the engine's GEMM is kept; a GEMM
    that times faster by more is picked."""
    from services.executor import cpu_gemm, cpu_kernels

    cpu_kernels.kernels()
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))     # no choice remembered
    monkeypatch.delenv("PAGEDSERVE_CPU_GEMM", raising=False)
    monkeypatch.setattr(cpu_gemm, "usable_gemms", lambda: ["engine", "mkl", "onednn"])
    costs = {"engine": engine_cost, "mkl": 1.5, "onednn": 1.0}
    monkeypatch.setattr(cpu_gemm, "time_packed_gemm", lambda g, w, evict: costs[g])
    assert cpu_gemm.pick_fp32_gemm([torch.ones(8, 8)]) == picked


def test_the_gemm_choice_is_timed_once_per_machine_and_shapes_and_remembered(monkeypatch,
                                                                          tmp_path):
    """The first start times the GEMMs and keeps its choice under PAGEDSERVE_CACHE_DIR; a
    later start with the same weights' shapes takes it untimed; other shapes, an
    unreadable file or a choice that is no longer a candidate are timed anew."""
    from services.executor import cpu_gemm, cpu_kernels

    cpu_kernels.kernels()
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDSERVE_CPU_GEMM", raising=False)
    usable = ["engine", "mkl", "onednn"]
    monkeypatch.setattr(cpu_gemm, "usable_gemms", lambda: list(usable))
    timed = []

    def cost(gemm, w, evict):
        timed.append(gemm)
        return {"engine": 2.0, "mkl": 1.5, "onednn": 1.0}[gemm]
    monkeypatch.setattr(cpu_gemm, "time_packed_gemm", cost)
    weights = [torch.ones(8, 8)]
    assert cpu_gemm.pick_fp32_gemm(weights) == "onednn" and sorted(timed) == usable
    (kept,) = (tmp_path / "gemm").iterdir()
    timed.clear()
    assert cpu_gemm.pick_fp32_gemm(weights) == "onednn" and timed == []   # remembered
    assert cpu_gemm.pick_fp32_gemm([torch.ones(16, 8)]) == "onednn" and len(timed) == 3
    timed.clear()
    kept.write_text("{not json")
    assert cpu_gemm.pick_fp32_gemm(weights) == "onednn" and len(timed) == 3
    assert json.loads(kept.read_text()) == {"choice": "onednn"}           # kept again
    timed.clear()
    usable.remove("onednn")              # e.g. found wrong here: the choice is timed again
    assert cpu_gemm.pick_fp32_gemm(weights) == "mkl" and sorted(timed) == ["engine", "mkl"]


def test_config_errors_say_what_to_pass(monkeypatch):
    from services.executor.config import ExecutorConfig, ExecutorConfigError

    with pytest.raises(ExecutorConfigError, match="dtype 'fp8'.*float32"):
        ExecutorConfig(dtype="fp8").validate()
    with pytest.raises(ExecutorConfigError, match="block_size must be a power of two"):
        ExecutorConfig(block_size=12).validate()
    with pytest.raises(ExecutorConfigError, match="cuda_graph_max_batch must be >= 0"):
        ExecutorConfig(cuda_graph_max_batch=-1).validate()
    monkeypatch.setenv("PAGEDSERVE_KV_CACHE_GIB", "3.5")
    monkeypatch.setenv("PAGEDSERVE_MAX_MODEL_LEN", "512")
    cfg = ExecutorConfig.from_env()
    assert cfg.kv_cache_gib == 3.5 and cfg.max_model_len == 512
    monkeypatch.setenv("PAGEDSERVE_BLOCK_SIZE", "big")
    with pytest.raises(ExecutorConfigError, match="PAGEDSERVE_BLOCK_SIZE='big'"):
        ExecutorConfig.from_env()


def test_cuda_graph_sizes_pad_every_batch_by_less_than_16_rows():
    from services.executor.cuda_graphs import graph_sizes

    assert graph_sizes(256)[:6] == [1, 2, 4, 8, 16, 32] and graph_sizes(256)[-1] == 256
    assert graph_sizes(8) == [1, 2, 4, 8] and graph_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    for top in (1, 8, 40, 256):
        sizes = graph_sizes(top)
        assert sizes == sorted(set(sizes))
        for n in range(1, top + 1):
            padded = next(s for s in sizes if s >= n)
            assert padded - n < 16 and (n > 8 or padded < 2 * n)


def test_cpu_runner_has_no_cuda_graphs(tiny_llama):
    folder, _ = tiny_llama
    assert tiny_runner(folder).graphs is None


def test_cpu_refuses_float16_with_a_hint(tiny_llama):
    from services.executor.config import ExecutorConfigError

    with pytest.raises(ExecutorConfigError, match="float16 is not supported on the CPU"):
        tiny_runner(tiny_llama[0], dtype="float16")


def test_a_kv_cache_larger_than_the_host_memory_is_refused_with_a_hint(tiny_llama):
    """A pool and swap space that the host's available memory cannot hold are refused
    before they are allocated (a pool that only just fits would be zero-filled into the
    OOM killer), naming both sizes and what to lower."""
    from services.executor.config import ExecutorConfigError
    from services.executor.model_runner import host_memory_available

    available = host_memory_available()
    assert available is not None and available > 0          # (Linux: /proc/meminfo)
    gib = 2 * available / 2 ** 30
    with pytest.raises(ExecutorConfigError, match=r"GiB of host memory and [0-9.]+ GiB is "
                       r"available: lower kv_cache_gib or swap_space_gib"):
        tiny_runner(tiny_llama[0], swap_space_gib=gib)


def test_a_kv_cache_the_allocator_refuses_is_a_config_error(tiny_llama, monkeypatch):
    """Where the allocation itself fails (a GPU pool, or a host that refuses), the error
    names the KV cache and what to lower instead of a traceback."""
    from services.executor import model_runner
    from services.executor.config import ExecutorConfigError

    def refuse(*_a, **_k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. "
                           "DefaultCPUAllocator: can't allocate memory\nmore")

    monkeypatch.setattr(model_runner, "KVCache", refuse)
    with pytest.raises(ExecutorConfigError, match=r"the KV cache \(.* GiB on cpu, .* GiB of "
                       r"swap space\) could not be allocated \(.*can't allocate memory\): "
                       r"lower kv_cache_gib"):
        tiny_runner(tiny_llama[0])


def test_a_negative_thread_count_is_refused(tiny_llama):
    from services.executor.config import ExecutorConfigError

    with pytest.raises(ExecutorConfigError, match="num_threads must be >= 0"):
        tiny_runner(tiny_llama[0], num_threads=-3)


def test_a_decode_planned_ahead_takes_the_token_the_executor_sampled_last(tiny):
    """-1 as a decode's appended token (a plan sent before the step before it answered,
    services/scheduler/ahead.py) is the token this executor sampled for the seq in its last
    step: the same tokens as the scheduler's own; a seq with no sample yet, or after a
    failed step, gets a clear error instead of a made-up token."""
    r, _ = tiny
    want = _generate(r, 6)
    res = r.execute(step_plan(0, [NewSeq(1, "r", PROMPT, len(PROMPT), list(range(6)), GREEDY)],
                              [Row(1, 0, len(PROMPT))]))
    got = [res.token_ids[0]]
    for i in range(5):
        res = r.execute(step_plan(i + 1, rows=[Row(1, len(PROMPT) + i, 1, [-1])]))
        assert res.error is None, res.error
        got.append(res.token_ids[0])
    assert got == want
    assert r.seqs[1].token_ids == PROMPT + want[:-1]
    failed = r.execute(step_plan(7, rows=[Row(1, 0, 99)]))     # a failed step ...
    assert failed.error is not None
    after = r.execute(step_plan(8, rows=[Row(1, len(PROMPT) + 5, 1, [-1])]))
    assert "sampled none" in after.error                    # ... leaves nothing to stand for
    r.execute(StepPlan(9, finished_seq_ids=[1]))
    fresh = r.execute(step_plan(10, [NewSeq(2, "r", PROMPT, len(PROMPT), [0, 1, 2], GREEDY)],
                                [Row(2, 0, 1, [-1])], sampling=0))
    assert "sampled none" in fresh.error and "Traceback" not in fresh.error
    r.execute(StepPlan(11, finished_seq_ids=[2]))


def test_bf16_c_kernels_give_the_torch_ops_logits(tiny_llama, monkeypatch):
    """A bf16 model runs its norms, RoPE and SiLU in the C kernels: its logits stay within
    bf16 rounding of the torch ops path's (PAGEDSERVE_CPU_KERNELS=torch)."""
    from services.executor import cpu_kernels

    folder, _hf = tiny_llama
    if cpu_kernels.kernels() is None:
        pytest.skip("no C compiler: only the torch ops path runs here")
    tokens = PROMPT + [8, 8, 1, 77]
    fused = tiny_runner(folder, dtype="bfloat16")
    assert fused.model.fused
    got = teacher_forced_logits(fused, tokens, len(PROMPT), chunk=5)
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    plain = tiny_runner(folder, dtype="bfloat16")
    assert not plain.model.fused
    want = teacher_forced_logits(plain, tokens, len(PROMPT), chunk=5)
    assert (got - want).abs().max() < 0.02 * want.abs().max()


def test_bf16_kv_cache_under_an_fp32_model(tiny_llama, monkeypatch):
    """--kv-cache-dtype bfloat16 under an fp32 model: both pools hold bf16, twice the blocks
    fit the same budget, the logits stay within bf16 rounding of K/V of transformers' fp32,
    and the C kernels and the torch ops path read and write the cache alike."""
    from services.executor import cpu_kernels

    folder, hf = tiny_llama
    r = tiny_runner(folder, kv_cache_dtype="bfloat16")
    assert r.dtype == torch.float32
    assert r.kv.gpu.dtype == torch.bfloat16 and r.kv.cpu.dtype == torch.bfloat16
    tokens = PROMPT + [8, 8, 1, 77]
    got = teacher_forced_logits(r, tokens, len(PROMPT), chunk=5)
    ref = hf_logits(hf, tokens, len(PROMPT))
    assert 0 < (got - ref).abs().max() < 0.02 * ref.abs().max()
    # the same budget holds twice the blocks
    full = tiny_runner(folder, num_gpu_blocks=None, kv_cache_gib=0.001)
    half = tiny_runner(folder, num_gpu_blocks=None, kv_cache_gib=0.001,
                       kv_cache_dtype="bfloat16")
    assert half.num_gpu_blocks in (2 * full.num_gpu_blocks, 2 * full.num_gpu_blocks + 1)
    if cpu_kernels.kernels() is None:
        return
    assert r.model.fused
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    plain = tiny_runner(folder, kv_cache_dtype="bfloat16")
    assert not plain.model.fused
    want = teacher_forced_logits(plain, tokens, len(PROMPT), chunk=5)
    # The fused norms and RoPE round their fp32 sums in another order than the torch ops:
    # where a K/V value lands next to a bf16 rounding boundary the two caches hold values a
    # bf16 step apart (1.8e-4 of the largest logit on an AMD EPYC Zen 3, with either path
    # on the same GEMM). A cache read or written in the wrong place is off by O(1).
    assert (got - want).abs().max() < 1e-3 * want.abs().max()


def test_kv_cache_dtypes_that_do_not_fit_the_model_are_refused_with_a_hint(tiny_llama):
    from services.executor.config import ExecutorConfig, ExecutorConfigError

    with pytest.raises(ExecutorConfigError, match="kv_cache_dtype 'fp8'.*bfloat16"):
        ExecutorConfig(kv_cache_dtype="fp8").validate()
    with pytest.raises(ExecutorConfigError,
                       match="kv_cache_dtype float32 under a bfloat16 model.*use auto"):
        tiny_runner(tiny_llama[0], dtype="bfloat16", kv_cache_dtype="float32")
    with pytest.raises(ExecutorConfigError, match="float16 under a float32 model.*bfloat16"):
        tiny_runner(tiny_llama[0], kv_cache_dtype="float16")
    assert tiny_runner(tiny_llama[0], kv_cache_dtype="float32").kv.gpu.dtype == torch.float32


def test_decode_steps_take_the_heads_at_once_picked_for_this_cpu(tiny_llama, monkeypatch):
    """The runner asks pick_decode_heads once, at load, for its model's heads and pool, and
    every decode step's C kernel call takes that choice; the greedy tokens are those of the
    heads together."""
    from services.executor import attention, cpu_kernels, model_runner

    if cpu_kernels.kernels() is None:
        pytest.skip("no C compiler: no C kernels")
    folder, _hf = tiny_llama
    asked, used = [], []
    monkeypatch.setattr(model_runner, "pick_decode_heads",
                        lambda *a: asked.append(a) or 1)
    real = cpu_kernels.decode_attention
    monkeypatch.setattr(cpu_kernels, "decode_attention",
                        lambda *a, **kw: used.append(kw["heads_at_once"]) or real(*a, **kw))
    one = _generate(tiny_runner(folder), 6)
    assert asked == [(4, 2, 16, torch.float32, 4)]      # heads of 64 / 4
    assert used and set(used) == {1}
    used.clear()
    monkeypatch.setattr(model_runner, "pick_decode_heads", attention.pick_decode_heads)
    together = tiny_runner(folder)
    assert together.decode_heads in (1, cpu_kernels.HEADS_AT_ONCE)
    assert _generate(together, 6) == one
