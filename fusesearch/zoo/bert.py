"""BERT encoder (Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers", 2019).

Idioms (opset 12, as a typical PyTorch export of Hugging Face BERT emits them):
- word-embedding `Gather`; position ids as a `Constant` node sliced to the sequence length;
  token-type ids from `ConstantOfShape` and the token-type table as a `Constant` node (weights
  that arrive as computed constants, not initializers);
- LayerNorm DECOMPOSED: ReduceMean(axes attribute) → Sub → Pow → ReduceMean → Add eps → Sqrt →
  Div → Mul → Add;
- attention: MatMul then Add bias (not Gemm); head split / merge by Reshape whose target shape is
  computed by Shape → Gather → Unsqueeze → Concat chains; Transpose; Div by sqrt(d);
  mask path Unsqueeze → Cast → Sub(1, mask) → Mul(-10000) → Add; Softmax(axis=-1) (opset-12
  semantics coerce to 2-D, still correct on the last axis);
- inference `Dropout` after attention probabilities and projections; `Identity` nodes;
- GELU with `Erf`; pooler: Gather(first token) → Gemm → Tanh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import BadInput
from ._builder import GraphBuilder, dim_of, gelu_erf, gemm, linear, unsqueeze

OPSET = 12
LN_EPS = 1e-12
MASK_VALUE = -10000.0


@dataclass(frozen=True)
class BertConfig:
    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    max_positions: int = 512
    type_vocab: int = 2

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.heads, self.intermediate, self.vocab) < 1:
            raise BadInput(f"bert: every size must be >= 1, got {self}")
        if self.hidden % self.heads:
            raise BadInput(f"bert: hidden={self.hidden} must be a multiple of heads={self.heads}; give heads "
                           "(--heads) that divide hidden (--hidden)")


def layer_norm_decomposed(b: GraphBuilder, x: str, dim: int, eps: float = LN_EPS) -> str:
    """LayerNorm over the last axis as opset-12 exporters write it, node by node."""
    name = b.fresh("layer_norm")
    mean = b.op("ReduceMean", [x], axes=[-1], keepdims=1)
    centered = b.op("Sub", [x, mean])
    var = b.op("ReduceMean", [b.op("Pow", [centered, b.scalar(2.0)])], axes=[-1], keepdims=1)
    std = b.op("Sqrt", [b.op("Add", [var, b.scalar(eps)])])
    y = b.op("Mul", [b.op("Div", [centered, std]), b.uniform(f"{name}.weight", (dim,), 0.5, 1.5)])
    return b.op("Add", [y, b.normal(f"{name}.bias", (dim,), 0.1)])


def _embeddings(b: GraphBuilder, ids: str, cfg: BertConfig) -> str:
    shape = b.op("Shape", [ids])
    words = b.op("Gather", [b.weight("word_embeddings", (cfg.vocab, cfg.hidden), 0.02), ids])
    positions = np.arange(cfg.max_positions, dtype=np.int64)[None, :]
    pos_ids = b.op("Slice", [b.constant_node(positions), b.ints([0]), dim_of(b, shape, 1),
                             b.ints([1])])
    pos = b.op("Gather", [b.weight("position_embeddings", (cfg.max_positions, cfg.hidden), 0.02),
                          pos_ids])
    zero = helper.make_tensor("zero", TensorProto.INT64, [1], [0])
    type_ids = b.op("ConstantOfShape", [shape], value=zero)
    type_table = b.rng.random((cfg.type_vocab, cfg.hidden), dtype=np.float32) * 0.04 - 0.02
    types = b.op("Gather", [b.constant_node(type_table), type_ids])
    x = b.op("Add", [b.op("Add", [words, pos]), types])
    return b.op("Dropout", [layer_norm_decomposed(b, x, cfg.hidden)])


def _extended_mask(b: GraphBuilder, mask: str) -> str:
    """[batch, seq] int64 of 0/1 → [batch, 1, 1, seq] float of 0 / -10000."""
    m = b.op("Cast", [unsqueeze(b, unsqueeze(b, mask, [1]), [2])], to=TensorProto.FLOAT)
    inverted = b.op("Sub", [b.scalar(1.0), m])
    return b.op("Identity", [b.op("Mul", [inverted, b.scalar(MASK_VALUE)])])


def _split_heads(b: GraphBuilder, x: str, cfg: BertConfig, perm: list[int]) -> str:
    shape = b.op("Shape", [x])
    head_dims = b.ints([cfg.heads, cfg.hidden // cfg.heads])
    target = b.op("Concat", [dim_of(b, shape, 0), dim_of(b, shape, 1), head_dims], axis=0)
    return b.op("Transpose", [b.op("Reshape", [x, target])], perm=perm)


def _merge_heads(b: GraphBuilder, ctx: str, cfg: BertConfig) -> str:
    y = b.op("Transpose", [ctx], perm=[0, 2, 1, 3])
    shape = b.op("Shape", [y])
    target = b.op("Concat", [dim_of(b, shape, 0), dim_of(b, shape, 1), b.ints([cfg.hidden])],
                  axis=0)
    return b.op("Reshape", [y, target])


def _attention(b: GraphBuilder, x: str, mask: str, cfg: BertConfig) -> str:
    q = _split_heads(b, linear(b, x, cfg.hidden, cfg.hidden), cfg, [0, 2, 1, 3])
    k = _split_heads(b, linear(b, x, cfg.hidden, cfg.hidden), cfg, [0, 2, 3, 1])
    v = _split_heads(b, linear(b, x, cfg.hidden, cfg.hidden), cfg, [0, 2, 1, 3])
    scale = b.scalar(math.sqrt(cfg.hidden // cfg.heads))
    scores = b.op("Add", [b.op("Div", [b.op("MatMul", [q, k]), scale]), mask])
    probs = b.op("Dropout", [b.op("Softmax", [scores], axis=-1)])
    ctx = _merge_heads(b, b.op("MatMul", [probs, v]), cfg)
    return b.op("Dropout", [linear(b, ctx, cfg.hidden, cfg.hidden)])


def _layer(b: GraphBuilder, x: str, mask: str, cfg: BertConfig) -> str:
    x = layer_norm_decomposed(b, b.op("Add", [_attention(b, x, mask, cfg), x]), cfg.hidden)
    y = gelu_erf(b, linear(b, x, cfg.hidden, cfg.intermediate))
    y = b.op("Dropout", [linear(b, y, cfg.intermediate, cfg.hidden)])
    return layer_norm_decomposed(b, b.op("Add", [y, x]), cfg.hidden)


def _pooler(b: GraphBuilder, x: str, cfg: BertConfig) -> str:
    first = b.op("Gather", [x, b.scalar(0, np.int64)], axis=1)
    return b.op("Tanh", [gemm(b, first, cfg.hidden, cfg.hidden)])


def build_bert(name: str, seed: int, cfg: BertConfig) -> onnx.ModelProto:
    b = GraphBuilder(name, seed, OPSET)
    ids = b.input("input_ids", ["batch", "seq"], TensorProto.INT64)
    mask = _extended_mask(b, b.input("attention_mask", ["batch", "seq"], TensorProto.INT64))
    x = _embeddings(b, ids, cfg)
    for _ in range(cfg.layers):
        x = _layer(b, x, mask, cfg)
    pooled = _pooler(b, x, cfg)
    b.output(b.op("Identity", [x]), "last_hidden_state", ["batch", "seq", cfg.hidden])
    b.output(pooled, "pooler_output", ["batch", cfg.hidden])
    return b.model(f"{name}: BERT encoder (Devlin et al. 2019), {cfg}, opset 12 export style.")


def bert_base(*, layers: int = 12, hidden: int = 768, heads: int = 12, intermediate: int = 3072,
              vocab: int = 30522) -> onnx.ModelProto:
    """BERT-base uncased: 12 layers, hidden 768, 12 heads, vocab 30522 (~110M weights)."""
    return build_bert("bert-base", 768, BertConfig(layers, hidden, heads, intermediate, vocab))


def bert_small(*, layers: int = 2, hidden: int = 128, heads: int = 2, intermediate: int = 512,
               vocab: int = 1000) -> onnx.ModelProto:
    """A small BERT for fast tests (the BERT-tiny shape with a 1000-token vocabulary)."""
    return build_bert("bert-small", 128, BertConfig(layers, hidden, heads, intermediate, vocab))
