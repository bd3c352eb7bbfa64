"""Model loading: HF folders round-trip into the engine's own forward, and the GGUF cache."""
from __future__ import annotations

import json

import pytest
import torch

from services.executor.config import ExecutorConfig
from services.executor.llama import UnsupportedModel
from services.executor.model_loader import load_model
from shared.messages import NewSeq, SamplingParams, StepPlan
from shared.model_source import ModelNotFound
from tests.executor.conftest import make_tiny_checkpoint, tiny_runner
from tests.executor.plans import Row, step_plan

TOL = 1e-4


def teacher_forced_logits(runner, tokens: list[int], prompt_len: int, chunk: int) -> torch.Tensor:
    """Logits the runner produces at positions prompt_len-1 .. len(tokens)-1: the prompt in
    prefill chunks of `chunk` tokens, then one decode per remaining token."""
    bs = runner.block_size
    table = list(range(-(-len(tokens) // bs)))
    runner.keep_logits = True
    rows = []
    step = 0
    new = [NewSeq(7, "r", tokens[:prompt_len], prompt_len, table, SamplingParams(temperature=0.0))]
    done = 0
    while done < prompt_len:
        n = min(chunk, prompt_len - done)
        res = runner.execute(step_plan(step, new, [Row(7, done, n)],
                                       sampling=int(done + n == prompt_len)))
        assert res.error is None, res.error
        done += n
        step += 1
        new = []
    rows.append(runner.last_logits[7])
    for t in range(prompt_len, len(tokens)):
        res = runner.execute(step_plan(step, rows=[Row(7, t, 1, [tokens[t]])]))
        assert res.error is None, res.error
        rows.append(runner.last_logits[7])
        step += 1
    runner.execute(StepPlan(step, finished_seq_ids=[7]))
    runner.keep_logits = False
    return torch.stack(rows)


def hf_logits(model, tokens: list[int], prompt_len: int) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, prompt_len - 1:].float()


def _tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def test_llama_folder_round_trips_into_fused_weights(tiny_llama):
    folder, hf = tiny_llama
    model = load_model(folder, torch.float32, torch.device("cpu"), 512)
    layer = model.layers[1]
    attn = hf.model.layers[1].self_attn
    assert torch.equal(layer.qkv.weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                                    attn.v_proj.weight]))
    mlp = hf.model.layers[1].mlp
    assert torch.equal(layer.gate_up.weight, torch.cat([mlp.gate_proj.weight,
                                                        mlp.up_proj.weight]))
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    r = tiny_runner(folder)
    tokens = _tokens(40)
    mine = teacher_forced_logits(r, tokens, 29, chunk=8)
    assert (mine - hf_logits(hf, tokens, 29)).abs().max() < TOL


def test_tied_embeddings_share_the_lm_head(tmp_path):
    hf = make_tiny_checkpoint(tmp_path, tie_word_embeddings=True)
    r = tiny_runner(tmp_path)
    assert r.model.lm_head.weight is r.model.embed
    tokens = _tokens(20)
    assert (teacher_forced_logits(r, tokens, 12, 5) - hf_logits(hf, tokens, 12)).abs().max() < TOL


def test_qwen2_qkv_bias_matches_transformers(tmp_path):
    hf = make_tiny_checkpoint(tmp_path, "qwen2")
    r = tiny_runner(tmp_path)
    assert r.model.layers[0].qkv.bias is not None and r.model.layers[0].o.bias is None
    tokens = _tokens(30, seed=1)
    mine = teacher_forced_logits(r, tokens, 20, chunk=7)
    ref = hf_logits(hf, tokens, 20)
    assert (mine - ref).abs().max() < TOL
    # The bias matters: without it the logits are far off (so the check above can fail).
    for layer in r.model.layers:
        layer.qkv.bias.zero_()
    assert (teacher_forced_logits(r, tokens, 20, chunk=7) - ref).abs().max() > 100 * TOL


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = make_tiny_checkpoint(tmp_path, rope_scaling=scaling, rope_theta=500000.0)
    r = tiny_runner(tmp_path)
    tokens = _tokens(160, seed=2)      # well past the original 64 positions
    mine = teacher_forced_logits(r, tokens, 150, chunk=64)
    ref = hf_logits(hf, tokens, 150)
    assert (mine - ref).abs().max() < TOL
    # Unscaled RoPE gives different logits at these positions.
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    plain = teacher_forced_logits(tiny_runner(tmp_path), tokens, 150, chunk=64)
    assert (plain - ref).abs().max() > 100 * TOL


def test_mistral_folder_matches_transformers(tmp_path):
    hf = make_tiny_checkpoint(tmp_path, "mistral", sliding_window=None)
    tokens = _tokens(24, seed=3)
    mine = teacher_forced_logits(tiny_runner(tmp_path), tokens, 16, chunk=16)
    assert (mine - hf_logits(hf, tokens, 16)).abs().max() < TOL


def test_bundled_gguf_is_converted_once_into_the_cache(runner):
    from services.executor.model_loader import ensure_hf_folder
    from shared.model_source import resolve_model

    source = resolve_model()
    folder = source.cache_dir
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        assert (folder / name).exists(), name
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert ensure_hf_folder(source) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert runner.model_name == "SmolLM2-135M-Instruct" and runner.eos_token_id == 2


def test_unknown_model_says_what_to_pass(tmp_path):
    from services.executor.model_runner import ModelRunner

    with pytest.raises(ModelNotFound, match="HF|Hugging Face|gguf"):
        ModelRunner(ExecutorConfig(model=str(tmp_path / "nope")))


def test_unsupported_architecture_is_refused_with_the_reason(tmp_path):
    make_tiny_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match="gpt2.*llama"):
        tiny_runner(tmp_path)


def _damage(folder, how: str) -> str:
    """Damage a saved tiny checkpoint; returns what the error must name."""
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    if how == "config_not_json":
        (folder / "config.json").write_text('{"model_type": "llama", ')
        return "config.json"
    if how == "weights_cut_short":
        data = weights.read_bytes()
        weights.write_bytes(data[:len(data) // 2])
        return "model.safetensors"
    state = load_file(weights)
    if how == "weight_missing":
        del state["model.layers.1.mlp.down_proj.weight"]
        save_file(state, weights, metadata={"format": "pt"})
        return "lacks 1 weights"
    assert how == "weight_of_another_shape"
    # fewer rows than config.json says: read as it is, it would fill part of the weight
    state["model.layers.0.mlp.gate_proj.weight"] = state["model.layers.0.mlp.gate_proj.weight"][:-8]
    save_file(state, weights, metadata={"format": "pt"})
    return "model.layers.0.mlp.gate_proj.weight"


@pytest.mark.parametrize("how", ["config_not_json", "weights_cut_short", "weight_missing",
                                 "weight_of_another_shape"])
def test_a_damaged_checkpoint_is_refused_with_what_is_wrong(tmp_path, how):
    """A folder that is there but cannot be read raises ModelUnreadable (a ModelNotFound:
    the launcher says it in one line), naming the file or the weight."""
    from shared.model_source import ModelUnreadable

    make_tiny_checkpoint(tmp_path)
    names = _damage(tmp_path, how)
    with pytest.raises(ModelUnreadable, match="cannot be read|lacks") as err:
        tiny_runner(tmp_path)
    assert names in str(err.value)
    assert isinstance(err.value, ModelNotFound)
