"""Vision Transformer (Dosovitskiy et al., "An Image is Worth 16x16 Words", ICLR 2021).

Idioms (opset 17): patch embedding as a 16x16 stride-16 Conv, Reshape/Transpose to tokens, a
class token broadcast with Shape → Gather → Unsqueeze → Concat → Expand and joined by `Concat`,
position-embedding Add, pre-norm encoder blocks with the `LayerNormalization` op, multi-head
attention as MatMul + Softmax(axis=-1), GELU written with `Erf`, final LayerNorm, and a Gemm head
on the class token (`Gather` index 0 on the token axis).
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from ._builder import GraphBuilder, dim_of, gelu_erf, gemm, layer_norm, linear

PATCH = 16
IMAGE = 224
TOKENS = (IMAGE // PATCH) ** 2 + 1  # 196 patches + the class token


def _embed(b: GraphBuilder, pixels: str, dim: int) -> str:
    name = b.fresh("conv")
    w = b.weight(f"{name}.weight", (dim, 3, PATCH, PATCH), 1.0 / math.sqrt(3 * PATCH * PATCH))
    y = b.op("Conv", [pixels, w, b.weight(f"{name}.bias", (dim,), 0.02)], name=name,
             kernel_shape=[PATCH, PATCH], strides=[PATCH, PATCH])
    tokens = b.op("Transpose", [b.op("Reshape", [y, b.ints([0, dim, -1])])], perm=[0, 2, 1])
    batch = dim_of(b, b.op("Shape", [pixels]), 0)
    cls_shape = b.op("Concat", [batch, b.ints([1, dim])], axis=0)
    cls = b.op("Expand", [b.weight("cls_token", (1, 1, dim), 0.02), cls_shape])
    y = b.op("Concat", [cls, tokens], axis=1)
    return b.op("Add", [y, b.weight("pos_embedding", (1, TOKENS, dim), 0.02)])


def _heads(b: GraphBuilder, x: str, heads: int, dim: int, perm: list[int]) -> str:
    y = b.op("Reshape", [linear(b, x, dim, dim), b.ints([0, 0, heads, dim // heads])])
    return b.op("Transpose", [y], perm=perm)


def _attention(b: GraphBuilder, x: str, dim: int, heads: int) -> str:
    q = _heads(b, x, heads, dim, [0, 2, 1, 3])
    k = _heads(b, x, heads, dim, [0, 2, 3, 1])
    v = _heads(b, x, heads, dim, [0, 2, 1, 3])
    scores = b.op("Mul", [b.op("MatMul", [q, k]), b.scalar(1.0 / math.sqrt(dim // heads))])
    ctx = b.op("MatMul", [b.op("Softmax", [scores], axis=-1), v])
    ctx = b.op("Reshape", [b.op("Transpose", [ctx], perm=[0, 2, 1, 3]), b.ints([0, 0, dim])])
    return linear(b, ctx, dim, dim)


def _block(b: GraphBuilder, x: str, dim: int, heads: int) -> str:
    x = b.op("Add", [x, _attention(b, layer_norm(b, x, dim, 1e-6), dim, heads)])
    y = gelu_erf(b, linear(b, layer_norm(b, x, dim, 1e-6), dim, 4 * dim))
    return b.op("Add", [x, linear(b, y, 4 * dim, dim)])


def _vit(name: str, seed: int, layers: int, dim: int, heads: int) -> onnx.ModelProto:
    b = GraphBuilder(name, seed, 17)
    x = _embed(b, b.input("pixel_values", ["batch", 3, IMAGE, IMAGE]), dim)
    for _ in range(layers):
        x = _block(b, x, dim, heads)
    cls = b.op("Gather", [layer_norm(b, x, dim, 1e-6), b.scalar(0, np.int64)], axis=1)
    b.output(gemm(b, cls, dim, 1000), "logits", ["batch", 1000])
    return b.model(f"{name}: ViT (Dosovitskiy et al. 2021), {layers} layers, dim {dim}, "
                   f"{heads} heads, opset 17.")


def vit_small() -> onnx.ModelProto:
    """ViT-S/16: 12 layers, dim 384, 6 heads."""
    return _vit("vit-small", 384, 12, 384, 6)


def vit_base() -> onnx.ModelProto:
    """ViT-B/16: 12 layers, dim 768, 12 heads."""
    return _vit("vit-base", 768, 12, 768, 12)
