"""Session fixtures of the executor tests: the real SmolLM2 runner and its transformers twin.

Loading (and, on a fresh machine, converting the bundled GGUF once) takes the bulk of the
setup; both models are built once per session.
"""
from __future__ import annotations

import pytest
import torch

from services.executor.config import ExecutorConfig

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning, my friend' into Spanish.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What is 17 times 23?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Name four planets of the solar system.",
    "How do I make a cup of green tea?",
    "Tell me a joke about computers.",
    "What does a CPU cache do?",
    "Describe the colour red to someone who cannot see.",
    "Suggest a name for a small black cat.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="session")
def runner():
    """The bundled SmolLM2-135M-Instruct in fp32 on the CPU, with a small KV pool."""
    from services.executor.model_runner import ModelRunner

    torch.manual_seed(0)
    return ModelRunner(ExecutorConfig(dtype="float32", device="cpu", num_gpu_blocks=320,
                                      swap_space_gib=0.25))


@pytest.fixture(scope="session")
def tokenizer():
    from shared.model_source import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model())


@pytest.fixture(scope="session")
def hf_model(runner):
    """transformers' own Llama on the very weights the runner loaded (the converted cache)."""
    from transformers import AutoModelForCausalLM

    from shared.model_source import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model().cache_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def chat_prompts(tokenizer) -> list[list[int]]:
    out = []
    for text in CHAT_PROMPTS:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True)
        out.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return out


# ---------------------------------------------------------------- tiny random checkpoints

def make_tiny_checkpoint(folder, arch: str = "llama", **overrides):
    """save_pretrained of a tiny random model; weights (biases, norms too) drawn wide enough
    that a missing bias or a wrong rotation shows in the logits. Returns the HF model."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)

    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                          "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                          "mistral": (MistralConfig, MistralForCausalLM)}[arch]
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              eos_token_id=2, tie_word_embeddings=False)
    kw.update(overrides)
    torch.manual_seed(1234)
    model = model_cls(cfg_cls(**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1 if p.dim() == 1 else 0.15)
    model.save_pretrained(folder)
    return model


def tiny_runner(folder, **cfg):
    from services.executor.model_runner import ModelRunner

    base = dict(model=str(folder), dtype="float32", device="cpu", num_gpu_blocks=64,
                swap_space_gib=0.001, block_size=4)
    base.update(cfg)
    return ModelRunner(ExecutorConfig(**base))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(folder, transformers model) of a tiny random Llama (GQA 4 q heads / 2 kv heads)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, make_tiny_checkpoint(folder)
