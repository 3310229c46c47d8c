"""A small recurrent model with control flow: an Elman RNN cell (Elman, "Finding Structure in
Time", Cognitive Science 1990) unrolled by an ONNX `Loop`, then a data-dependent `If`.

Idioms (opset 13): `Loop` with a fixed trip count and a constant-true condition whose body
(MatMul + Add + Tanh) carries a hidden state and reads outer-scope tensors (the input and the
weights); `If` on a condition computed from data (ReduceSum > 0) with two branches doing different
elementwise work; plain MatMul / Add / Tanh / Softmax before and after. Control-flow nodes are
OPAQUE to fusion and their subgraphs must be carried through untouched.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto

from ._builder import GraphBuilder, linear

FEATURES = 16
HIDDEN = 32
CLASSES = 10
STEPS = 4
STATE = ["batch", HIDDEN]


def _cell_body(b: GraphBuilder, x: str) -> onnx.GraphProto:
    """Loop body (iteration, cond, h) → (cond, tanh(h·W_hh + x·W_xh + b))."""
    body = b.child("rnn_cell")
    body.input("iteration", [], TensorProto.INT64)
    cond = body.input("cond_in", [], TensorProto.BOOL)
    h = body.input("h_in", STATE)
    w_hh = b.weight("rnn.w_hh", (HIDDEN, HIDDEN), 1.0 / math.sqrt(HIDDEN))
    w_xh = b.weight("rnn.w_xh", (FEATURES, HIDDEN), 1.0 / math.sqrt(FEATURES))
    pre = body.op("Add", [body.op("MatMul", [h, w_hh]), body.op("MatMul", [x, w_xh])])
    h_new = body.op("Tanh", [body.op("Add", [pre, b.weight("rnn.bias", (HIDDEN,), 0.05)])])
    body.output(body.op("Identity", [cond]), "cond_out", [], TensorProto.BOOL)
    body.output(h_new, "h_out", STATE)
    return body.graph()


def _branch(
    b: GraphBuilder, name: str, h: str, ops: list[tuple[str, float | None]]
) -> onnx.GraphProto:
    """An If branch applying a short elementwise chain to the outer-scope tensor `h`."""
    branch = b.child(name)
    y = h
    for op_type, constant in ops:
        y = branch.op(op_type, [y] if constant is None else [y, branch.scalar(constant)])
    branch.output(y, f"{name}_out", STATE)
    return branch.graph()


def _gate(b: GraphBuilder, h: str) -> str:
    cond = b.op("Greater", [b.op("ReduceSum", [h], keepdims=0), b.scalar(0.0)])
    then = _branch(b, "then_branch", h, [("Mul", 2.0), ("Relu", None)])
    other = _branch(b, "else_branch", h, [("Add", 1.0), ("Sigmoid", None), ("Neg", None)])
    return b.op("If", [cond], then_branch=then, else_branch=other)


def rnn_control() -> onnx.ModelProto:
    """Encoder → 4-step RNN `Loop` → sign-gated `If` → classifier, on [batch, 16] features."""
    b = GraphBuilder("rnn-control", 13, 13)
    x = b.input("features", ["batch", FEATURES])
    h0 = b.op("Tanh", [linear(b, x, FEATURES, HIDDEN)])
    steps = b.param("loop.trip_count", np.array(STEPS, dtype=np.int64))
    keep_going = b.param("loop.cond", np.array(True))
    h = b.op("Loop", [steps, keep_going, h0], body=_cell_body(b, x))
    logits = linear(b, _gate(b, h), HIDDEN, CLASSES)
    b.output(b.op("Softmax", [logits], axis=-1), "probs", ["batch", CLASSES])
    return b.model("Elman RNN unrolled by Loop (4 steps) + data-dependent If, opset 13.")
