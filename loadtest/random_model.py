"""A random-weight checkpoint with SmolLM2-135M-Instruct's shapes, for machines without the
bundled GGUF (the GPU machines the benchmarks and GPU tests run on receive only the repo).

Same config as the bundled model: 30 layers, hidden 576, MLP 1536, 9 query heads over 3
KV heads of 64, vocabulary 49152, tied embeddings, rope theta 100000, so kernel shapes,
FLOPs and KV bytes per token are the real model's. Weights are drawn like an initialised
model (std 0.02, norms 1), which keeps activations in a realistic range; the text it
generates is noise, which the throughput and logit comparisons do not care about.

    python loadtest/random_model.py /tmp/smollm2-random            # 135 M params, fp32
    python loadtest/random_model.py /tmp/small --layers 4
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def make_random_smollm2(folder: str | Path, layers: int | None = None, seed: int = 0):
    """save_pretrained a random SmolLM2-135M-shaped Llama (fp32) into `folder`; returns the
    transformers model (on the CPU, in eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(SMOLLM2_135M)
    if layers is not None:
        kw["num_hidden_layers"] = layers
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (default: 30)")
    args = ap.parse_args()
    model = make_random_smollm2(args.folder, args.layers)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.folder}: {params / 1e6:.1f} M params, "
          f"{model.config.num_hidden_layers} layers")


if __name__ == "__main__":
    main()
