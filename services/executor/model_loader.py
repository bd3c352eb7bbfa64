"""Model loading: resolve the source, convert a GGUF once, read safetensors into fused weights.

    --model value ──resolve_model──▶ HF folder ──────────────────────────┐
                                    GGUF file ──convert once──▶ cache dir ┴─▶ LlamaModel

The conversion dequantises the GGUF through transformers (which also undoes llama.cpp's
Q/K row permutation) and writes config.json + model.safetensors + tokenizer files into
ModelSource.cache_dir, so later starts only read safetensors (seconds).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from services.executor.llama import LlamaArgs, LlamaModel
from services.executor.parallel import Shard
from shared.model_source import (ModelNotFound, ModelSource, ModelUnreadable, load_tokenizer,
                                 reading)

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"


def ensure_hf_folder(source: ModelSource) -> Path:
    """A folder holding config.json + *.safetensors for `source`, converting a GGUF once."""
    if source.hf_dir is not None:
        if not any(source.hf_dir.glob("*.safetensors")):
            raise ModelNotFound(f"{source.hf_dir} has no *.safetensors weights: save the model "
                                "with save_pretrained(..., safe_serialization=True)")
        return source.hf_dir
    out = source.cache_dir
    if (out / WEIGHTS_FILE).exists() and (out / "config.json").exists():
        return out
    convert_gguf(source)
    return out


def convert_gguf(source: ModelSource) -> Path:
    """Dequantise source.gguf_file into source.cache_dir (HF layout). Atomic per file:
    model.safetensors, the marker of a finished conversion, is renamed into place last."""
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out = source.cache_dir
    out.mkdir(parents=True, exist_ok=True)
    load_tokenizer(source)  # writes the tokenizer files into the same folder
    log.info("converting %s once into %s", source.gguf_file, out)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    with reading(source.gguf_file):
        model = AutoModelForCausalLM.from_pretrained(
            source.gguf_file.parent, gguf_file=source.gguf_file.name, **{dtype_kw: torch.float32})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    tied = cfg.get("tie_word_embeddings", False)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    tmp = out.parent / f".{out.name}.convert-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        save_file(state, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        os.replace(tmp / "config.json", out / "config.json")
        os.replace(tmp / WEIGHTS_FILE, out / WEIGHTS_FILE)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_args(folder: Path) -> LlamaArgs:
    with reading(folder / "config.json"):
        config = json.loads((folder / "config.json").read_text())
    return LlamaArgs.from_hf_config(config)


def load_model(folder: Path, dtype: torch.dtype, device: torch.device, max_model_len: int,
               progress: bool = True, shard: Shard = Shard()) -> LlamaModel:
    """Build a LlamaModel from folder's config.json and *.safetensors (q/k/v and gate/up fused).

    With tensor parallelism (`shard.size` > 1) only this rank's heads and MLP rows are read
    (see services/executor/parallel.py); the model's args then describe the local slice.
    """
    full = read_args(folder)
    shard.check(full.num_heads, full.num_kv_heads)
    q0, q1 = shard.heads(full.num_heads)
    k0, k1 = shard.heads(full.num_kv_heads)
    i0, i1 = shard.span(full.intermediate_size)
    args = replace(full, num_heads=q1 - q0, num_kv_heads=k1 - k0, intermediate_size=i1 - i0)
    model = LlamaModel(args, dtype, device, max_model_len)
    model.full_args = full
    h, d, i = args.hidden_size, args.head_dim, args.intermediate_size
    nq, nkv = args.num_heads * d, args.num_kv_heads * d
    lead = shard.rank == 0            # adds the biases that follow an all-reduce
    new = lambda *shape: torch.empty(shape, dtype=dtype, device=device)  # noqa: E731
    q_rows, kv_rows = (q0 * d, q1 * d), (k0 * d, k1 * d)
    # Where each checkpoint tensor goes: (target, first row, rows to read, columns to read);
    # q/k/v and gate/up land in one fused tensor each.
    targets: dict[str, tuple[torch.Tensor, int, tuple | None, tuple | None]] = {}
    model.embed = new(args.vocab_size, h)
    targets["model.embed_tokens.weight"] = (model.embed, 0, None, None)
    model.norm = new(h)
    targets["model.norm.weight"] = (model.norm, 0, None, None)
    if not args.tie_word_embeddings and lead:
        model.lm_head.weight = new(args.vocab_size, h)
        targets["lm_head.weight"] = (model.lm_head.weight, 0, None, None)
    for n, layer in enumerate(model.layers):
        p = f"model.layers.{n}."
        layer.input_norm, layer.post_norm = new(h), new(h)
        qkv, o = layer.qkv, layer.o
        gate_up, down = layer.gate_up, layer.down
        qkv.weight, o.weight = new(nq + 2 * nkv, h), new(h, nq)
        gate_up.weight, down.weight = new(2 * i, h), new(h, i)
        targets |= {p + "input_layernorm.weight": (layer.input_norm, 0, None, None),
                    p + "post_attention_layernorm.weight": (layer.post_norm, 0, None, None),
                    p + "self_attn.q_proj.weight": (qkv.weight, 0, q_rows, None),
                    p + "self_attn.k_proj.weight": (qkv.weight, nq, kv_rows, None),
                    p + "self_attn.v_proj.weight": (qkv.weight, nq + nkv, kv_rows, None),
                    p + "self_attn.o_proj.weight": (o.weight, 0, None, q_rows),
                    p + "mlp.gate_proj.weight": (gate_up.weight, 0, (i0, i1), None),
                    p + "mlp.up_proj.weight": (gate_up.weight, i, (i0, i1), None),
                    p + "mlp.down_proj.weight": (down.weight, 0, None, (i0, i1))}
        if args.qkv_bias:
            qkv.bias = new(nq + 2 * nkv)
            targets |= {p + "self_attn.q_proj.bias": (qkv.bias, 0, q_rows, None),
                        p + "self_attn.k_proj.bias": (qkv.bias, nq, kv_rows, None),
                        p + "self_attn.v_proj.bias": (qkv.bias, nq + nkv, kv_rows, None)}
        if args.o_bias and lead:
            o.bias = new(h)
            targets[p + "self_attn.o_proj.bias"] = (o.bias, 0, None, None)
        if args.mlp_bias:
            gate_up.bias = new(2 * i)
            targets |= {p + "mlp.gate_proj.bias": (gate_up.bias, 0, (i0, i1), None),
                        p + "mlp.up_proj.bias": (gate_up.bias, i, (i0, i1), None)}
            if lead:
                down.bias = new(h)
                targets[p + "mlp.down_proj.bias"] = (down.bias, 0, None, None)
    missing = set(targets)
    files = sorted(folder.glob("*.safetensors"))
    bar = tqdm(total=len(targets), desc=f"loading {folder.name}", unit="tensor",
               disable=not progress)
    for f in files:
        with reading(f), safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name not in targets:
                    continue    # e.g. rotary_emb.inv_freq, or lm_head.weight of a tied model
                dst, row, rows, cols = targets[name]
                part = st.get_slice(name)
                if rows is not None:
                    src = part[rows[0]:rows[1]]
                elif cols is not None:
                    src = part[:, cols[0]:cols[1]]
                else:
                    src = part[:]
                want = (rows[1] - rows[0] if rows is not None else dst.shape[0],
                        *dst.shape[1:])
                if tuple(src.shape) != want:     # (a short tensor would fill part of dst)
                    raise ValueError(f"{name} is {list(part.get_shape())} in the checkpoint, "
                                     "which does not fit config.json")
                dst[row:row + src.shape[0]].copy_(src)
                missing.discard(name)
                bar.update(1)
    bar.close()
    if missing:
        raise ModelUnreadable(f"{folder} lacks {len(missing)} weights the config needs, e.g. "
                              f"{sorted(missing)[:3]}: the checkpoint and config.json disagree")
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed
    return model
