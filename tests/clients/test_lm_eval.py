"""lm-evaluation-harness, unmodified: `local-completions` through `pagedserve serve` scores a
multiple-choice task exactly as lm-eval's own `hf` backend does on the same weights.

`local-completions` asks for loglikelihoods the way it asks vLLM: prompts as token-id
lists, several in one request (batch_size 4), `echo: true`, `logprobs: 1`, `max_tokens: 1`,
and reads each prompt token's logprob back from the echoed prompt. The `hf` backend runs
the model in transformers from the HF folder the stack converted the bundled GGUF into
(the same fp32 weights). The task lives in tests/clients/lm_eval_task (no download).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a dev dependency (make install)")

TASK_DIR = Path(__file__).parent / "lm_eval_task"
MODEL = "SmolLM2-135M-Instruct"


def _task() -> dict:
    task = yaml.safe_load((TASK_DIR / "pagedserve_mc.yaml").read_text())
    task["dataset_kwargs"]["data_files"]["test"] = str(TASK_DIR / "mc.jsonl")
    return task


def _evaluate(model: str, model_args: str, batch_size: int) -> tuple[float, list]:
    """(accuracy, per document the loglikelihood of each choice)."""
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[_task()],
                                  batch_size=batch_size, log_samples=True, num_fewshot=0,
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    samples = sorted(out["samples"]["pagedserve_mc"], key=lambda s: s["doc_id"])
    logliks = [[resp[0][0] for resp in s["resps"]] for s in samples]
    return out["results"]["pagedserve_mc"]["acc,none"], logliks


def test_local_completions_loglikelihoods_equal_the_hf_backend(stack, hf_dir, monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    served_acc, served = _evaluate(
        "local-completions",
        f"model={MODEL},base_url={stack.base_url}/v1/completions,tokenizer={hf_dir},"
        "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1,timeout=120",
        batch_size=4)
    hf_acc, local = _evaluate("hf", f"pretrained={hf_dir},dtype=float32,device=cpu",
                              batch_size=8)
    assert len(served) == len(local) == 12
    for doc, (ours, theirs) in enumerate(zip(served, local)):
        assert ours == pytest.approx(theirs, abs=1e-3), f"document {doc}"
    assert served_acc == hf_acc
