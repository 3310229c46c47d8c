"""LLaMA-style decoder (Touvron et al., 2023; grouped-query attention, Ainslie et al., 2023) in the two
graphs an inference export writes: prefill (sequence `seq`) and one decode step (after `past`).

Problem: the zoo needs a modern decoder in the idioms the PyTorch exporter writes (opset 17, Hugging
Face's `LlamaForCausalLM`).
Approach: pre-norm blocks with RMSNorm node by node (Pow → ReduceMean → Add ε → Sqrt → Reciprocal
→ Mul, Mul by weight); bias-free MatMul projections; rotary embeddings from cos/sin tables
(`Gather` by position ids, `rotate_half` as two Slices, Neg, Concat); GQA with key/value heads
repeated by Unsqueeze → `Expand` → Reshape; an in-graph causal mask (Trilu, `Where`) in prefill;
the KV cache as inputs `past_key_values.{i}.key/value` joined by `Concat`, outputs
`present.{i}.key/value`; a SwiGLU MLP (SiLU as x · Sigmoid(x)); an untied LM head.
Invariants: weights are drawn from the seeded generator up to `DRAWN_WEIGHTS_LIMIT` values; above
it (`LLAMA_8B`) every weight is a graph input of its static shape unless `weights=1` asks for them
(`weights=0` forces shapes only)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import BadInput
from ._builder import GraphBuilder, dim_of, unsqueeze

OPSET = 17
RMS_EPS = 1e-5
ROPE_THETA = 10000.0
DRAWN_WEIGHTS_LIMIT = 64_000_000  # float32 values (256 MB); above, weights are shapes only
INT64_MAX = np.iinfo(np.int64).max

# Llama-3-8B's shapes: the full-size sweep point (`build_model("llama-prefill", **LLAMA_8B)`)
LLAMA_8B = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336,
            "vocab": 128256, "max_positions": 8192}


@dataclass(frozen=True)
class LlamaConfig:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int

    def __post_init__(self) -> None:
        sizes = (self.layers, self.hidden, self.heads, self.kv_heads, self.intermediate, self.vocab,
                 self.max_positions)
        if min(sizes) < 1:
            raise BadInput(f"llama: every size must be >= 1, got {self}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise BadInput(f"llama: hidden={self.hidden} must be heads={self.heads} times an even "
                           "head size (rotary embeddings rotate pairs)")
        if self.heads % self.kv_heads:
            raise BadInput(f"llama: heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def weight_count(self) -> int:
        kv = self.kv_heads * self.head_dim
        block = 2 * self.hidden * (self.hidden + kv) + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * block + 2 * self.vocab * self.hidden + self.hidden


def rms_norm(b: GraphBuilder, x: str, dim: int) -> str:
    """x · 1/√(mean(x²) + ε) · weight, node by node."""
    name = b.fresh("rms_norm")
    var = b.op("ReduceMean", [b.op("Pow", [x, b.scalar(2.0)])], axes=[-1], keepdims=1)
    inv = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [var, b.scalar(RMS_EPS)])])])
    return b.op("Mul", [b.uniform(f"{name}.weight", (dim,), 0.5, 1.5), b.op("Mul", [x, inv])])


def _proj(b: GraphBuilder, x: str, din: int, dout: int) -> str:
    name = b.fresh("matmul")
    return b.op("MatMul", [x, b.weight(f"{name}.weight", (din, dout), 1.0 / math.sqrt(din))], name=name)


def _rope_tables(b: GraphBuilder, positions: str, cfg: LlamaConfig) -> tuple[str, str]:
    """cos and sin [1, 1, seq, head_dim] at `positions` (1-d int64), from [max_positions,
    head_dim] tables (each frequency twice: the halves rotate together)."""
    half = cfg.head_dim // 2
    freqs = ROPE_THETA ** (-np.arange(half, dtype=np.float64) / half)
    angles = np.outer(np.arange(cfg.max_positions, dtype=np.float64), freqs)
    angles = np.concatenate([angles, angles], axis=1)
    out = []
    for fn, name in ((np.cos, "rope.cos"), (np.sin, "rope.sin")):
        table = b.param(name, fn(angles).astype(np.float32))
        out.append(unsqueeze(b, b.op("Gather", [table, positions], axis=0), [0, 1]))
    return out[0], out[1]


def _rotate(b: GraphBuilder, x: str, cos: str, sin: str, cfg: LlamaConfig) -> str:
    """x · cos + rotate_half(x) · sin, rotate_half(x) = concat(−x[..., d/2:], x[..., :d/2])."""
    half, axis = cfg.head_dim // 2, b.ints([-1])
    x1 = b.op("Slice", [x, b.ints([0]), b.ints([half]), axis])
    x2 = b.op("Slice", [x, b.ints([half]), b.ints([INT64_MAX]), axis])
    rotated = b.op("Concat", [b.op("Neg", [x2]), x1], axis=-1)
    return b.op("Add", [b.op("Mul", [x, cos]), b.op("Mul", [rotated, sin])])


def _heads(b: GraphBuilder, x: str, heads: int, cfg: LlamaConfig) -> str:
    """[batch, seq, heads · head_dim] → [batch, heads, seq, head_dim]."""
    y = b.op("Reshape", [x, b.ints([0, 0, heads, cfg.head_dim])])
    return b.op("Transpose", [y], perm=[0, 2, 1, 3])


def _repeat_kv(b: GraphBuilder, x: str, cfg: LlamaConfig) -> str:
    """[batch, kv_heads, T, d] → [batch, heads, T, d], each kv head repeated for its group."""
    n_rep = cfg.heads // cfg.kv_heads
    if n_rep == 1:
        return x
    expanded = b.op("Expand", [unsqueeze(b, x, [2]), b.ints([1, 1, n_rep, 1, 1])])
    return b.op("Reshape", [expanded, b.ints([0, cfg.heads, -1, cfg.head_dim])])


@dataclass(frozen=True)
class _Step:
    """What every block shares: rotary tables, the causal mask (prefill) and the cache dims."""

    cos: str
    sin: str
    causal: str | None
    past: bool


def _attention(b: GraphBuilder, x: str, i: int, step: _Step, cfg: LlamaConfig) -> str:
    kv = cfg.kv_heads * cfg.head_dim
    q = _rotate(b, _heads(b, _proj(b, x, cfg.hidden, cfg.hidden), cfg.heads, cfg), step.cos, step.sin, cfg)
    k = _rotate(b, _heads(b, _proj(b, x, cfg.hidden, kv), cfg.kv_heads, cfg), step.cos, step.sin, cfg)
    v = _heads(b, _proj(b, x, cfg.hidden, kv), cfg.kv_heads, cfg)
    k, v = (_cache(b, t, f"{i}.{name}", step, cfg) for t, name in ((k, "key"), (v, "value")))
    kt = b.op("Transpose", [_repeat_kv(b, k, cfg)], perm=[0, 1, 3, 2])
    scores = b.op("Div", [b.op("MatMul", [q, kt]), b.scalar(math.sqrt(cfg.head_dim))])
    if step.causal is not None:
        scores = b.op("Where", [step.causal, scores, b.scalar(float(np.finfo(np.float32).min))])
    probs = b.op("Softmax", [scores], axis=-1)
    ctx = b.op("Transpose", [b.op("MatMul", [probs, _repeat_kv(b, v, cfg)])], perm=[0, 2, 1, 3])
    ctx = b.op("Reshape", [ctx, b.ints([0, 0, cfg.hidden])])
    return _proj(b, ctx, cfg.hidden, cfg.hidden)


def _cache(b: GraphBuilder, t: str, which: str, step: _Step, cfg: LlamaConfig) -> str:
    """The present keys or values: `t` after the past ones (decode), exposed as an output."""
    if step.past:
        past = b.input(f"past_key_values.{which}", ["batch", cfg.kv_heads, "past", cfg.head_dim])
        t = b.op("Concat", [past, t], axis=2)
    return b.output(t, f"present.{which}", ["batch", cfg.kv_heads, "total" if step.past else "seq",
                                             cfg.head_dim])


def _mlp(b: GraphBuilder, x: str, cfg: LlamaConfig) -> str:
    gate = _proj(b, x, cfg.hidden, cfg.intermediate)
    silu = b.op("Mul", [gate, b.op("Sigmoid", [gate])])
    up = _proj(b, x, cfg.hidden, cfg.intermediate)
    return _proj(b, b.op("Mul", [silu, up]), cfg.intermediate, cfg.hidden)


def _block(b: GraphBuilder, x: str, i: int, step: _Step, cfg: LlamaConfig) -> str:
    x = b.op("Add", [x, _attention(b, rms_norm(b, x, cfg.hidden), i, step, cfg)])
    return b.op("Add", [x, _mlp(b, rms_norm(b, x, cfg.hidden), cfg)])


def _causal_mask(b: GraphBuilder, seq: str) -> str:
    """[seq, seq] bool, true on and below the diagonal."""
    seq_1d = unsqueeze(b, seq, [0])
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    ones = b.op("ConstantOfShape", [b.op("Concat", [seq_1d, seq_1d], axis=0)], value=one)
    return b.op("Cast", [b.op("Trilu", [ones], upper=0)], to=TensorProto.BOOL)


def build_llama(name: str, seed: int, cfg: LlamaConfig, *, decode: bool, weights: int | None) -> onnx.ModelProto:
    if weights not in (None, 0, 1):
        raise BadInput(f"llama: weights={weights}: give 1 (draw them), 0 (shapes only) or leave it out "
                       f"(drawn up to {DRAWN_WEIGHTS_LIMIT:,} values)")
    shapes_only = cfg.weight_count() > DRAWN_WEIGHTS_LIMIT if weights is None else not weights
    b = GraphBuilder(name, seed, OPSET, shapes_only=shapes_only)
    ids = b.input("input_ids", ["batch", 1 if decode else "seq"], TensorProto.INT64)
    x = b.op("Gather", [b.weight("embed_tokens", (cfg.vocab, cfg.hidden), 1.0), ids], axis=0)
    if decode:
        # the new token's position: the cache's length, as `past.size(2)` exports (the first
        # block declares the input)
        positions = dim_of(b, b.op("Shape", ["past_key_values.0.key"]), 2)
        causal = None
    else:
        one = b.scalar(1, np.int64)
        seq = b.op("Gather", [b.op("Shape", [ids]), one], axis=0)
        positions = b.op("Range", [b.scalar(0, np.int64), seq, one])
        causal = _causal_mask(b, seq)
    cos, sin = _rope_tables(b, positions, cfg)
    step = _Step(cos, sin, causal, decode)
    for i in range(cfg.layers):
        x = _block(b, x, i, step, cfg)
    logits = _proj(b, rms_norm(b, x, cfg.hidden), cfg.hidden, cfg.vocab)
    b.output(logits, "logits", ["batch", 1 if decode else "seq", cfg.vocab])
    return b.model(f"{name}: LLaMA-style decoder ({'decode step' if decode else 'prefill'}), {cfg}, "
                    f"opset 17, {'weights as shaped inputs' if shapes_only else 'drawn weights'}.")


def _config(layers, hidden, heads, kv_heads, intermediate, vocab, max_positions) -> LlamaConfig:
    return LlamaConfig(layers, hidden, heads, kv_heads, intermediate, vocab, max_positions)


def llama_prefill(*, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                  intermediate: int = 176, vocab: int = 1000, max_positions: int = 512,
                  weights: int | None = None) -> onnx.ModelProto:
    """The prompt pass over `seq` tokens; small by default, `LLAMA_8B` for full-size shapes."""
    cfg = _config(layers, hidden, heads, kv_heads, intermediate, vocab, max_positions)
    return build_llama("llama-prefill", 5, cfg, decode=False, weights=weights)


def llama_decode(*, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                 intermediate: int = 176, vocab: int = 1000, max_positions: int = 512,
                 weights: int | None = None) -> onnx.ModelProto:
    """One generated token after `past` cached positions; the same sizes as `llama_prefill`."""
    cfg = _config(layers, hidden, heads, kv_heads, intermediate, vocab, max_positions)
    return build_llama("llama-decode", 5, cfg, decode=True, weights=weights)
