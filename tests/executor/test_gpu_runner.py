"""The executor on a CUDA GPU, against transformers on the same GPU (skipped without CUDA).

What only a GPU exercises: the Triton kernels inside the real forward (paged attention with
prefill tiles, decode tiles and context splits; the K/V write; the block swap between the
GPU pool and pinned host memory), decode steps replayed from CUDA graphs (padded batch
sizes), the KV pool sized from the memory left after a profiling forward, and the CUDA
sampling path.

The model has SmolLM2-135M-Instruct's shapes (9 query heads over 3 KV heads of 64, vocab
49152, tied embeddings) with random weights (loadtest/random_model.py): GPU machines get
the repository, not the bundled GGUF. Prompts run up to 1,200 tokens, so decodes of a few
sequences cut their context into splits (flash decoding) and the merge kernel runs.

PAGEDSERVE_GPU_TESTS_DEVICE=cpu runs the same checks on the CPU path (a dry run of the
test itself; PAGEDSERVE_GPU_TESTS_LAYERS=2 makes it quick).
"""
from __future__ import annotations

import gc
import os

import pytest
import torch

from shared.messages import SamplingParams
from tests.executor.plans import PlanBuilder

DEVICE = os.environ.get("PAGEDSERVE_GPU_TESTS_DEVICE", "cuda")
LAYERS = int(os.environ.get("PAGEDSERVE_GPU_TESTS_LAYERS", "30"))
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA GPU")

PROMPT_LENS = [1, 7, 16, 17, 33, 64, 130, 255, 512, 700, 1031, 1200]
NEW_TOKENS = 24
BUDGET = 256         # tokens per step: long prompts take several chunks beside decodes


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(folder, transformers model on DEVICE in fp32)."""
    from loadtest.random_model import make_random_smollm2

    folder = tmp_path_factory.mktemp("smollm2-random")
    hf = make_random_smollm2(folder, layers=LAYERS)
    return folder, hf.to(DEVICE)


def _runner(folder, dtype: str, **extra):
    from services.executor.config import ExecutorConfig
    from services.executor.model_runner import ModelRunner

    cfg = dict(model=str(folder), dtype=dtype, device=DEVICE, swap_space_gib=0.5,
               max_num_batched_tokens=BUDGET, gpu_memory_utilization=0.5, **extra)
    if DEVICE == "cpu":
        cfg["num_gpu_blocks"] = 512
    else:
        gc.collect()                 # an earlier test's pool must not count as in use
        torch.cuda.empty_cache()
    return ModelRunner(ExecutorConfig(**cfg))


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _generate(runner, prompts, preempt=None):
    """Greedy NEW_TOKENS per prompt in one continuous batch; per-seq logits rows (CPU)."""
    b = PlanBuilder(runner.num_gpu_blocks, runner.num_cpu_blocks, runner.block_size, BUDGET)
    for i, p in enumerate(prompts):
        b.add(i, p, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), NEW_TOKENS)
    logits: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    runner.keep_logits = True
    try:
        while not b.done:
            assert b.step_id < 1000, "generation did not finish"
            if preempt is not None:
                preempt(b)
            b.apply(runner.execute(b.next_plan()))
            for sid, row in runner.last_logits.items():
                logits[sid].append(row.float().cpu())
            runner.last_logits = {}
        runner.execute(b.next_plan())
    finally:
        runner.keep_logits = False
    assert not runner.seqs
    return b, logits


def _reference(hf, b: PlanBuilder) -> dict[int, torch.Tensor]:
    """transformers' logits after each prefix (one teacher-forced forward per sequence)."""
    out = {}
    with torch.inference_mode():
        for sid, seq in b.seqs.items():
            ids = torch.tensor([seq.prompt + seq.outputs[:-1]], device=DEVICE)
            out[sid] = hf(ids).logits[0, seq.prompt_len - 1:].float().cpu()
    return out


def _swap_then_recompute(b: PlanBuilder, state: dict) -> None:
    """Swap out every other running sequence once some decode, bring them back two steps
    later, then drop three running sequences for recompute."""
    running = [s for s in b.seqs.values() if s.state == "running"]
    if "out" not in state and sum(len(s.outputs) >= 4 for s in running) >= 3:
        state["out"] = [s.seq_id for s in running[::2]]
        state["at"] = b.step_id
        for sid in state["out"]:
            b.swap_out(sid)
    elif "out" in state and "in" not in state and b.step_id >= state["at"] + 2:
        state["in"] = {sid: b.swap_in(sid) for sid in state["out"]}
    elif "in" in state and "dropped" not in state and sum(
            len(s.outputs) >= 12 for s in running) >= 3:
        state["dropped"] = [s.seq_id for s in running if s.outputs][:3]
        for sid in state["dropped"]:
            b.recompute(sid)


def test_fp32_runner_matches_transformers_through_swap_and_recompute(model):
    folder, hf = model
    runner = _runner(folder, "float32")
    assert runner.device.type == DEVICE and runner.kv.gpu.device.type == DEVICE
    if DEVICE == "cuda":
        assert runner.kv.cpu.is_pinned(), "the swap pool of a GPU executor is pinned memory"
    prompts = _prompts(runner.args.vocab_size)
    state: dict = {}
    b, logits = _generate(runner, prompts, lambda b: _swap_then_recompute(b, state))
    assert len(state.get("out", [])) >= 2 and len(state.get("dropped", [])) == 3
    if DEVICE == "cuda":    # decode steps came from graphs, at several padded sizes
        assert runner.graphs.replays > 0 and runner.graphs.graphs
    ref = _reference(hf, b)
    for sid, seq in b.seqs.items():
        mine = torch.stack(logits[sid])
        assert mine.shape == ref[sid].shape == (NEW_TOKENS, runner.args.vocab_size)
        err = (mine - ref[sid]).abs().max().item()
        assert err < 1e-3, f"prompt of {PROMPT_LENS[sid]} tokens: logits differ by {err:.2e}"
        top2 = ref[sid].topk(2, dim=-1).values
        for t, tok in enumerate(seq.outputs):
            if tok != int(ref[sid][t].argmax()):
                gap = float(top2[t, 0] - top2[t, 1])
                assert gap < 1e-4, f"seq {sid} step {t}: not greedy (top-2 gap {gap:.2e})"


def test_bf16_runner_stays_close_to_fp32_transformers(model):
    folder, hf = model
    runner = _runner(folder, "bfloat16")
    assert runner.dtype == torch.bfloat16 and runner.kv.gpu.dtype == torch.bfloat16
    prompts = _prompts(runner.args.vocab_size)
    b, logits = _generate(runner, prompts)
    ref = _reference(hf, b)
    for sid in b.seqs:
        mine, want = torch.stack(logits[sid]), ref[sid]
        assert torch.isfinite(mine).all()
        # bf16 keeps about 3 significant digits through 30 layers: close, not identical
        scale = want.abs().max().item()
        err = (mine - want).abs().max().item()
        assert 0 < err < 0.05 * scale, f"seq {sid}: {err:.3e} against logits up to {scale:.2f}"


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs exist only there")
def test_graph_replay_equals_eager_decode(model):
    """The same generation with decode steps replayed from graphs and run eagerly: the same
    tokens, and logits equal up to the summation order of a different split count."""
    folder, hf = model
    prompts = _prompts(hf.config.vocab_size)
    eager = _runner(folder, "float32", cuda_graph_max_batch=0)
    assert eager.graphs is None
    b_eager, l_eager = _generate(eager, prompts)
    del eager
    graphs = _runner(folder, "float32", cuda_graph_max_batch=8)   # bigger batches: eager
    b_graph, l_graph = _generate(graphs, prompts)
    assert graphs.graphs.replays > 0
    for sid in b_eager.seqs:
        want, got = b_eager.seqs[sid].outputs, b_graph.seqs[sid].outputs
        # up to a divergence, which only a near-tie may cause (it changes all that follows)
        same = next((t for t in range(NEW_TOKENS) if got[t] != want[t]), NEW_TOKENS)
        ref, mine = torch.stack(l_eager[sid][:same + 1]), torch.stack(l_graph[sid][:same + 1])
        err = (mine[:same] - ref[:same]).abs().max().item() if same else 0.0
        assert err < 1e-4, f"seq {sid}: graph and eager logits differ by {err:.2e}"
        if same < NEW_TOKENS:
            top2 = ref[same].topk(2).values
            assert top2[0] - top2[1] < 1e-4, f"seq {sid} diverges at {same} without a tie"


@pytest.mark.skipif(DEVICE != "cuda", reason="the pool is sized from GPU memory only there")
def test_gpu_pool_is_sized_from_the_memory_fraction(model):
    folder, _ = model
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info()
    runner = _runner(folder, "bfloat16")
    held = torch.cuda.memory_reserved()
    # The pool takes most of the allowed half; weights and activations take the rest.
    assert runner.num_gpu_blocks * runner.block_size > 100_000
    assert held <= 0.5 * total + (total - free0), (held, total)
    assert runner.kv.gpu.numel() * 2 > 0.3 * total * 0.5
