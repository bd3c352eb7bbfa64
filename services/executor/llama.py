"""The Llama-family forward (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat token batch.

The engine owns this code; transformers only supplies config.json, the tokenizer and the
one-time GGUF conversion. One forward takes the tokens of every scheduled sequence
concatenated (prefill chunks and decodes mixed) and writes each token's K/V into its
paged slot before attention reads the context back from the pool.

Weights are fused for large matmuls: per layer one [q|k|v] projection and one
[gate|up] projection. The output rows of qkv_proj are laid out as

    [ q heads 0..Hq-1 | k heads 0..Hkv-1 | v heads 0..Hkv-1 ]   (head_dim columns each)

so RoPE runs once over the adjacent q and k heads. The LM head runs only on the rows that
need logits (`compute_logits`), never on every prefill token.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from services.executor import cpu_kernels
from services.executor.attention import AttentionMetadata, paged_attention, write_kv
from services.executor import cpu_gemm
from services.executor.cpu_gemm import bf16_gemm, pick_fp32_gemm
from services.executor.parallel import ProcessGroup

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")


class UnsupportedModel(ValueError):
    """config.json describes a model this forward cannot run; the message says why."""


@dataclass(slots=True)
class LlamaArgs:
    """The architecture numbers read from a Hugging Face config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False           # Qwen2 always; Llama with attention_bias
    o_bias: bool = False             # Llama with attention_bias
    mlp_bias: bool = False
    rope_scaling: dict = field(default_factory=dict)   # {"rope_type": "llama3", "factor": ...}
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "LlamaArgs":
        """Parse config.json (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHS:
            raise UnsupportedModel(f"model_type {model_type!r} is not supported: this executor "
                                   f"runs {', '.join(SUPPORTED_ARCHS)} checkpoints")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ("default", "llama3", "linear"):
            raise UnsupportedModel(f"rope_type {rope_type!r} is not supported "
                                   "(default, linear and llama3 are)")
        rope["rope_type"] = rope_type
        eos = cfg.get("eos_token_id")
        window = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
            o_bias=model_type != "qwen2" and cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            rope_scaling=rope,
            sliding_window=window,
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * d
        layer = qkv + self.num_heads * d * h + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, with Llama 3 / linear scaling applied."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = args.rope_scaling
    if rs["rope_type"] == "linear":
        return inv_freq / rs["factor"]
    if rs["rope_type"] == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
        # between the two wavelength cut-offs is interpolated smoothly.
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
        return torch.where(is_mid, mid, scaled)
    return inv_freq


class Linear:
    """y = x W^T + b; on the CPU through a weight packed once (see `pack_for_cpu`).

    `gemm` names the library of the packed weight: "engine" (cpu_kernels.c), "mkl" or
    "onednn" (fp32 and bf16); None while the weight is not packed. `glu`: a [gate | up]
    weight packed for `swiglu` only (the engine's GEMM applies silu(gate) * up itself).
    `min_rows`: fewer rows run padded to this many, so that a row gets the bits it gets in
    any batch (`cpu_gemm.min_rows`)."""

    __slots__ = ("weight", "bias", "packed", "gemm", "glu", "min_rows")

    def __init__(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        self.weight, self.bias, self.packed, self.gemm, self.glu = weight, bias, None, None, False
        self.min_rows = 1

    def set_packed(self, packed: torch.Tensor, gemm: str, glu: bool = False) -> None:
        """Use `packed` (this weight packed for `gemm`) from now on; call while `weight` is
        still the real one."""
        self.packed, self.gemm, self.glu = packed, gemm, glu
        self.min_rows = cpu_gemm.min_rows(gemm, packed, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if self.gemm == "engine":
            return cpu_kernels.linear(x, self.packed, self.weight.shape[0], self.bias)
        if self.gemm == "mkl":
            return cpu_gemm.mkl_linear(x, self.packed, self.weight, self.bias, self.min_rows)
        return cpu_gemm.onednn_linear(x, self.packed, self.bias, self.min_rows > 1)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up [T, I] of this [gate | up] weight, in the GEMM (needs `glu`)."""
        return cpu_kernels.linear(x, self.packed, self.weight.shape[0], glu=True)

    def add_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += x W^T + b in the GEMM's epilogue (needs gemm == "engine")."""
        cpu_kernels.linear(x, self.packed, self.weight.shape[0], self.bias, out=out,
                           accumulate=True)


class LlamaLayer:
    """One decoder layer: fused add+RMSNorm, attention over the paged pool, SwiGLU MLP."""

    __slots__ = ("input_norm", "post_norm", "qkv", "o", "gate_up", "down")

    def __init__(self) -> None:
        self.input_norm = self.post_norm = None
        self.qkv, self.o, self.gate_up, self.down = Linear(), Linear(), Linear(), Linear()


class LlamaModel:
    """Weights plus the forward. Plain tensors, no nn.Module: nothing runs but the math."""

    def __init__(self, args: LlamaArgs, dtype: torch.dtype, device: torch.device,
                 max_model_len: int) -> None:
        self.args = args                # this rank's slice (see parallel.py); == full_args at TP=1
        self.full_args = args
        self.group: ProcessGroup | None = None   # tensor-parallel ranks; None: one process
        self.dtype = dtype
        self.device = device
        self.embed: torch.Tensor | None = None      # [V, H]
        self.lm_head = Linear()                     # [V, H]; the embedding when tied
        self.norm: torch.Tensor | None = None       # [H]
        self.layers = [LlamaLayer() for _ in range(args.num_layers)]
        self.scale = args.head_dim ** -0.5
        # cos/sin per position [max_model_len, head_dim / 2], computed in fp32 as
        # transformers does, then cast to the activation dtype.
        pos = torch.arange(max_model_len, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(args))
        self.cos = freqs.cos().to(device=device, dtype=dtype)
        self.sin = freqs.sin().to(device=device, dtype=dtype)
        # The C kernels for norm, rope and activation (fp32 or bf16 on the CPU; the cos/sin
        # tables are in the model's dtype); see cpu_kernels.py.
        self.fused = (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                      and cpu_kernels.kernels() is not None)

    # ------------------------------------------------------------------ forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, H] (before the final norm) of a flat batch of T tokens.

        input_ids/positions: [T] int64, rows ordered as `meta` describes.
        kv_cache: [num_layers, 2, num_blocks, block_size, Hkv, D]; this step's K/V are
        written into it at meta.slot_mapping.
        """
        a = self.args
        t = input_ids.shape[0]
        nq, nkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        rope = None if self.fused else (self.cos.index_select(0, positions).unsqueeze(1),
                                        self.sin.index_select(0, positions).unsqueeze(1))
        residual = F.embedding(input_ids, self.embed)   # [T, H], owned: updated in place
        h = None
        for i, layer in enumerate(self.layers):
            x = self._add_norm(residual, h, layer.input_norm)
            qkv = layer.qkv(x)                          # [T, (Hq + 2 Hkv) D]
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            self._rope_and_cache(qkv, positions, rope, meta, k_cache, v_cache)
            q = qkv[:, :nq * d].view(t, nq, d)
            k = qkv[:, nq * d:(nq + nkv) * d].view(t, nkv, d)
            v = qkv[:, (nq + nkv) * d:].view(t, nkv, d)
            o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
            h = self._project(layer.o, o.view(t, nq * d), residual)
            x = self._add_norm(residual, h, layer.post_norm)
            h = self._project(layer.down, self._swiglu(layer.gate_up, x), residual)
        if h is not None:
            residual.add_(h)
        return residual

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Tensor parallelism: sum each rank's partial [T, H] projection output."""
        return partial if self.group is None else self.group.all_reduce(partial)

    def _project(self, lin: Linear, x: torch.Tensor, residual: torch.Tensor):
        """The output projection x W^T, summed over the ranks, for the residual stream.
        Where the GEMM can add it into `residual` itself (the engine's GEMM, one rank), it does, and
        this returns None: no [T, H] temporary and one pass less over the rows."""
        if lin.gemm == "engine" and self.group is None:
            lin.add_into(x, residual)
            return None
        return self._reduce(lin(x))

    def _swiglu(self, gate_up: Linear, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up: in the GEMM where it can (`glu`), else GEMM then activation."""
        return gate_up.swiglu(x) if gate_up.glu else self._silu_and_mul(gate_up(x))

    # Each step below has a fused C version (CPU, fp32 and bf16) and the torch ops it
    # replaces.

    def _add_norm(self, residual: torch.Tensor, h: torch.Tensor | None,
                  weight: torch.Tensor) -> torch.Tensor:
        """residual += h (in place), then RMSNorm of the residual."""
        if self.fused:
            return cpu_kernels.add_rms_norm(residual, h, weight, self.args.rms_norm_eps)
        if h is not None:
            residual.add_(h)
        return _rms_norm(residual, weight, self.args.rms_norm_eps)

    def _rope_and_cache(self, qkv, positions, rope, meta, k_cache, v_cache) -> None:
        a = self.args
        if self.fused:
            cpu_kernels.rope_and_cache(qkv, positions, self.cos, self.sin, meta.slot_mapping,
                                       k_cache, v_cache, a.num_heads, a.num_kv_heads)
            return
        t, d = qkv.shape[0], a.head_dim
        qk = qkv[:, :(a.num_heads + a.num_kv_heads) * d].view(t, -1, d)
        _apply_rope(qk, rope[0], rope[1], d // 2)
        write_kv(qk[:, a.num_heads:], qkv[:, (a.num_heads + a.num_kv_heads) * d:].view(
            t, a.num_kv_heads, d), k_cache, v_cache, meta)

    def _silu_and_mul(self, gu: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return cpu_kernels.silu_and_mul(gu)
        inter = gu.shape[1] // 2
        g = gu[:, :inter]
        F.silu(g, inplace=True)
        return g.mul_(gu[:, inter:])

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits [R, V] for the selected (pre-norm) hidden rows [R, H]."""
        x = _rms_norm(hidden_rows, self.norm, self.args.rms_norm_eps)
        return self.lm_head(x).float()

    def linears(self) -> list[Linear]:
        head = [self.lm_head] if self.lm_head.weight is not None else []   # rank 0 only at TP>1
        return [lin for layer in self.layers
                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + head

    def pack_for_cpu(self) -> bool:
        """Pack every projection once into the GEMM library's own layout, instead of letting
        it reorder the weight on every call. bf16 goes through oneDNN where the CPU
        multiplies bf16 itself (AMX, AVX-512 bf16), or the engine's own GEMM with the CPU's
        bf16 dot products where that is faster on this model's weights; else through the
        engine's own GEMM (bf16 weights widened to fp32 in registers: torch's plain bf16
        GEMM on an AVX2 CPU runs at a fifth of the fp32 rate), else oneDNN where it packs
        bf16 (`cpu_gemm.bf16_gemm`). fp32 goes through
        whichever of the engine's own GEMM, MKL's packed sgemm and oneDNN is usable
        and fastest on this CPU for this model's weights (cpu_gemm.py; docs/executor.md
        gives their speeds by row count).

        The original weights give way to zero-stride stand-ins of the same shape (the packed
        ops read only their shape), so memory stays at one copy. Returns False, changing
        nothing, where this torch build lacks MKL/oneDNN or the fp32 checks fail.
        """
        if self.device.type != "cpu":
            return False
        first = [lin.weight for lin in self.linears()[:4]]    # timed by the picks
        if self.dtype == torch.float32:
            gemm = pick_fp32_gemm(first)
            if gemm is None:
                return False
            pack = lambda w: cpu_gemm.pack_weight(gemm, w)  # noqa: E731
        elif self.dtype == torch.bfloat16:
            gemm = bf16_gemm(first)
            if gemm is None:
                return False
            pack = (cpu_kernels.pack_linear if gemm == "engine"
                    else torch.ops.mkldnn._reorder_linear_weight)
        else:
            return False
        # The engine's GEMM applies silu(gate) * up to the [gate | up] product itself.
        glu = {id(layer.gate_up) for layer in self.layers
               if gemm == "engine" and layer.gate_up.bias is None}
        try:
            packed = [cpu_kernels.pack_linear(lin.weight, glu=True) if id(lin) in glu
                      else pack(lin.weight) for lin in self.linears()]
        except RuntimeError as exc:   # e.g. oneDNN's bf16 reorder needs AVX512 or AVX-NE-CONVERT
            log.info("weights not prepacked (%s); using the plain GEMM", exc)
            return False
        for lin, p in zip(self.linears(), packed):
            w = lin.weight
            lin.set_packed(p, gemm, id(lin) in glu)
            if lin.weight is not self.embed:
                lin.weight = torch.zeros((), dtype=w.dtype).expand(w.shape)
        return True


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm: statistics in fp32, weight applied in the model dtype.
    # NOTE: composed ops beat F.rms_norm on the CPU in torch 2.x (it is not fused there).
    if x.dtype == torch.float32:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps)) * weight
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
    return weight * xf.to(x.dtype)


def _apply_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> None:
    """Rotate q and k heads [T, Hq + Hkv, D] in place (rotate-half convention)."""
    x1 = qk[..., :half]
    x2 = qk[..., half:]
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    x1.copy_(r1)
    x2.copy_(r2)
