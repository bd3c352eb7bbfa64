"""A random-weight checkpoint with SmolLM2-135M-Instruct's shapes, for machines without the
bundled GGUF (the GPU machines the benchmarks and GPU tests run on receive only the repo).

Same config as the bundled model: 30 layers, hidden 576, MLP 1536, 9 query heads over 3
KV heads of 64, vocabulary 49152, tied embeddings, rope theta 100000, so kernel shapes,
FLOPs and KV bytes per token are the real model's. Weights are drawn like an initialised
model (std 0.02, norms 1), which keeps activations in a realistic range; the text it
generates is noise, which the throughput and logit comparisons do not care about.

    python loadtest/random_model.py /tmp/smollm2-random            # 135 M params, fp32
    python loadtest/random_model.py /tmp/small --layers 4

`--shape llama3-8b` writes Llama-3.1-8B's shapes instead (32 layers, hidden 4096, MLP
14336, 32 query heads over 8 KV heads of 128, vocabulary 128256, rope theta 500000 with
llama3 scaling, untied head; 8.0 B params), drawn straight into safetensors shards in the
given dtype on the given device (a GPU draws the 16 GB of bf16 in seconds), plus a
synthetic byte-level tokenizer of the same vocabulary so that the whole stack
(`pagedserve serve --model FOLDER`) can serve it on a machine without Meta's files:

    python loadtest/random_model.py /tmp/llama8b --shape llama3-8b --dtype bfloat16 \
        --device cuda --tokenizer
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


LLAMA31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})
SHAPES = {"smollm2-135m": SMOLLM2_135M, "llama3-8b": LLAMA31_8B}


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


def write_random_llama(folder: str | Path, cfg: dict, dtype: torch.dtype,
                       device: str = "cpu", seed: int = 0, shard_bytes: int = 4 << 30) -> int:
    """Draw a random Llama of config `cfg` tensor by tensor on `device` (std 0.02, norms
    0.8-1.2) into folder/model-0000N.safetensors shards of about `shard_bytes`, with its
    config.json; nothing model-sized is held in host memory. Returns the parameter count."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h),
                       p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i),
                       p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    g = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    size = params = 0
    index = 0

    def flush() -> None:
        nonlocal shard, size, index
        index += 1
        save_file(shard, str(folder / f"model-{index:05d}.safetensors"), metadata={"format": "pt"})
        shard, size = {}, 0

    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.float32, device=device)
        if len(shape) == 1:
            t.uniform_(0.8, 1.2, generator=g)
        else:
            t.normal_(0.0, 0.02, generator=g)
        shard[name] = t.to(dtype).cpu()
        size += shard[name].nbytes
        params += t.numel()
        del t
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    config = dict(cfg, architectures=["LlamaForCausalLM"], model_type="llama",
                  hidden_act="silu", torch_dtype=str(dtype).removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return params


def write_byte_tokenizer(folder: str | Path, vocab_size: int, bos: int, eos: int) -> None:
    """A byte-level BPE tokenizer of exactly `vocab_size` ids: the 256 byte tokens, then
    filler tokens "<t{id}>" (no merges), bos/eos at their config ids. It round-trips any text
    through the bytes; generated filler ids decode to their names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_tokens = list(pre_tokenizers.ByteLevel.alphabet())
    byte_tokens.sort()
    vocab = {}
    for tid in range(vocab_size):
        if tid == bos:
            vocab["<|begin_of_text|>"] = tid
        elif tid == eos:
            vocab["<|end_of_text|>"] = tid
        elif tid < len(byte_tokens):
            vocab[byte_tokens[tid]] = tid
        else:
            vocab[f"<t{tid}>"] = tid
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|end_of_text|>")
    fast.save_pretrained(str(folder))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--device", default="cpu", help="where the weights are drawn (cuda: fast)")
    ap.add_argument("--tokenizer", action="store_true",
                    help="also write a synthetic byte-level tokenizer of the vocabulary")
    args = ap.parse_args()
    if args.shape != "smollm2-135m" or args.dtype != "float32" or args.tokenizer:
        cfg = dict(SHAPES[args.shape])
        if args.layers is not None:
            cfg["num_hidden_layers"] = args.layers
        params = write_random_llama(args.folder, cfg, getattr(torch, args.dtype), args.device)
        if args.tokenizer:
            write_byte_tokenizer(args.folder, cfg["vocab_size"], cfg["bos_token_id"],
                                 cfg["eos_token_id"])
        print(f"{args.folder}: {params / 1e9:.2f} B params, {cfg['num_hidden_layers']} layers, "
              f"{args.dtype}")
        return
    model = make_random_smollm2(args.folder, args.layers)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.folder}: {params / 1e6:.1f} M params, "
          f"{model.config.num_hidden_layers} layers")


if __name__ == "__main__":
    main()
