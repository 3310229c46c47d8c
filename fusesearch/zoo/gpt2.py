"""GPT-2 decoder (Radford et al., "Language Models are Unsupervised Multitask Learners", 2019).

Idioms (opset 17): token + position embedding `Gather`s with position ids from Shape → Gather →
`Range`; pre-norm blocks with the `LayerNormalization` op; a causal mask built in-graph (Trilu of
a ConstantOfShape of ones, sized by the input's Shape) applied with `Where` (masked scores take
float32's lowest value, as Hugging Face does); fused QKV MatMul + Add then `Split` into q, k, v;
GELU's tanh approximation written with Pow / Mul / Add / Tanh; a tied LM head (MatMul by a
`Transpose` of the token-embedding initializer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import BadInput
from ._builder import GraphBuilder, layer_norm, linear, unsqueeze

OPSET = 17
LN_EPS = 1e-5


@dataclass(frozen=True)
class GPT2Config:
    layers: int
    hidden: int
    heads: int
    vocab: int
    n_positions: int

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.heads, self.vocab, self.n_positions) < 1:
            raise BadInput(f"gpt2: every size must be >= 1, got {self}")
        if self.hidden % self.heads:
            raise BadInput(f"gpt2: hidden={self.hidden} must be a multiple of heads={self.heads}; give heads "
                           "(--heads) that divide hidden (--hidden)")


def gelu_tanh(b: GraphBuilder, x: str) -> str:
    """0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³))), node by node."""
    cube = b.op("Mul", [b.op("Pow", [x, b.scalar(3.0)]), b.scalar(0.044715)])
    inner = b.op("Mul", [b.op("Add", [x, cube]), b.scalar(math.sqrt(2.0 / math.pi))])
    y = b.op("Add", [b.op("Tanh", [inner]), b.scalar(1.0)])
    return b.op("Mul", [b.op("Mul", [x, b.scalar(0.5)]), y])


def _embeddings(b: GraphBuilder, ids: str, seq: str, cfg: GPT2Config) -> tuple[str, str]:
    """Returns (hidden states, token-embedding table) — the table is tied to the LM head."""
    wte = b.weight("wte", (cfg.vocab, cfg.hidden), 0.02)
    positions = b.op("Range", [b.scalar(0, np.int64), seq, b.scalar(1, np.int64)])
    wpe = b.weight("wpe", (cfg.n_positions, cfg.hidden), 0.01)
    pos = b.op("Gather", [wpe, unsqueeze(b, positions, [0])])
    return b.op("Add", [b.op("Gather", [wte, ids]), pos]), wte


def _causal_mask(b: GraphBuilder, seq: str) -> str:
    """[seq, seq] bool, true on and below the diagonal."""
    seq_1d = unsqueeze(b, seq, [0])
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    ones = b.op("ConstantOfShape", [b.op("Concat", [seq_1d, seq_1d], axis=0)], value=one)
    return b.op("Cast", [b.op("Trilu", [ones], upper=0)], to=TensorProto.BOOL)


def _heads(b: GraphBuilder, x: str, cfg: GPT2Config, perm: list[int]) -> str:
    y = b.op("Reshape", [x, b.ints([0, 0, cfg.heads, cfg.hidden // cfg.heads])])
    return b.op("Transpose", [y], perm=perm)


def _attention(b: GraphBuilder, x: str, causal: str, cfg: GPT2Config) -> str:
    q, k, v = b.op_multi("Split", [linear(b, x, cfg.hidden, 3 * cfg.hidden)], 3, axis=-1)
    q, v = _heads(b, q, cfg, [0, 2, 1, 3]), _heads(b, v, cfg, [0, 2, 1, 3])
    k = _heads(b, k, cfg, [0, 2, 3, 1])
    scale = b.scalar(math.sqrt(cfg.hidden // cfg.heads))
    scores = b.op("Div", [b.op("MatMul", [q, k]), scale])
    lowest = b.scalar(float(np.finfo(np.float32).min))
    probs = b.op("Softmax", [b.op("Where", [causal, scores, lowest])], axis=-1)
    ctx = b.op("Transpose", [b.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
    ctx = b.op("Reshape", [ctx, b.ints([0, 0, cfg.hidden])])
    return linear(b, ctx, cfg.hidden, cfg.hidden)


def _block(b: GraphBuilder, x: str, causal: str, cfg: GPT2Config) -> str:
    x = b.op("Add", [x, _attention(b, layer_norm(b, x, cfg.hidden, LN_EPS), causal, cfg)])
    y = gelu_tanh(b, linear(b, layer_norm(b, x, cfg.hidden, LN_EPS), cfg.hidden, 4 * cfg.hidden))
    return b.op("Add", [x, linear(b, y, 4 * cfg.hidden, cfg.hidden)])


def build_gpt2(name: str, seed: int, cfg: GPT2Config) -> onnx.ModelProto:
    b = GraphBuilder(name, seed, OPSET)
    ids = b.input("input_ids", ["batch", "seq"], TensorProto.INT64)
    seq = b.op("Gather", [b.op("Shape", [ids]), b.scalar(1, np.int64)], axis=0)
    x, wte = _embeddings(b, ids, seq, cfg)
    causal = _causal_mask(b, seq)
    for _ in range(cfg.layers):
        x = _block(b, x, causal, cfg)
    x = layer_norm(b, x, cfg.hidden, LN_EPS)
    logits = b.op("MatMul", [x, b.op("Transpose", [wte], perm=[1, 0])])
    b.output(logits, "logits", ["batch", "seq", cfg.vocab])
    return b.model(f"{name}: GPT-2 decoder (Radford et al. 2019), {cfg}, opset 17, tied head.")


def gpt2(*, layers: int = 12, hidden: int = 768, heads: int = 12, vocab: int = 50257,
         n_positions: int = 1024) -> onnx.ModelProto:
    """GPT-2 small (124M weights) by default; smaller shapes for tests via the parameters."""
    return build_gpt2("gpt2", 2, GPT2Config(layers, hidden, heads, vocab, n_positions))
