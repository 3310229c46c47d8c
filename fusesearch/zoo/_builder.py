"""Shared helper for the zoo builders: a small `GraphBuilder` plus the layers several models use.

Problem: every zoo model is written by hand with `onnx.helper`; each needs unique, readable node
names, deterministic weights and the same model boilerplate (opset, IR version, producer).
Approach: a `GraphBuilder` holds one numpy Generator (a fixed seed per model), a per-prefix
counter (`conv_12`, `bn_12`, `relu_13`), the node / initializer / input / output lists and a cache
of scalar constants. Layers (`conv`, `batch_norm`, `linear`, `gelu_erf`, ...) are free functions
over a builder, so a model module reads as its paper's block diagram.
Invariants: the same calls in the same order give byte-identical models; a node's single output
tensor has the node's name (graph outputs excepted: `output` renames them); node names are unique
in the whole model (a subgraph builder shares its parent's counters and generator).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

PRODUCER = "fusesearch.zoo"

# Short prefixes for long op names; every other op is named by its snake_case op type.
_PREFIX = {
    "BatchNormalization": "bn",
    "LayerNormalization": "ln",
    "GlobalAveragePool": "gap",
    "ConvTranspose": "convt",
    "MatMul": "matmul",
    "ConstantOfShape": "const_of_shape",
}

Dim = int | str | None


def _prefix(op_type: str) -> str:
    return _PREFIX.get(op_type) or re.sub(r"(?<!^)(?=[A-Z])", "_", op_type).lower()


class GraphBuilder:
    """Collects one ONNX graph: nodes, initializers, inputs and outputs, named and seeded."""

    def __init__(self, name: str, seed: int, opset: int, *, parent: GraphBuilder | None = None,
                 shapes_only: bool = False):
        self.name = name
        self.opset = opset
        # shapes only: every drawn weight becomes a graph input of its static shape (nothing drawn
        # or stored), for full-size models planned by shape alone
        self.shapes_only = parent.shapes_only if parent else shapes_only
        self.rng = parent.rng if parent else np.random.default_rng(seed)
        self._counts: dict[str, int] = parent._counts if parent else {}
        self._scalars: dict[tuple[str, bytes], str] = {}
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []

    def child(self, name: str) -> GraphBuilder:
        """A builder for a subgraph (Loop body, If branch) sharing names and the generator."""
        return GraphBuilder(name, 0, self.opset, parent=self)

    # ---- names and nodes -------------------------------------------------------------------
    def fresh(self, prefix: str) -> str:
        n = self._counts.get(prefix, 0)
        self._counts[prefix] = n + 1
        return f"{prefix}_{n}"

    def op(self, op_type: str, inputs: Sequence[str], *, name: str | None = None, **attrs) -> str:
        """Add a single-output node; its output tensor takes the node's name."""
        return self.op_multi(op_type, inputs, 1, name=name, **attrs)[0]

    def op_multi(
        self, op_type: str, inputs: Sequence[str], n_out: int, *, name: str | None = None, **attrs
    ) -> list[str]:
        name = name or self.fresh(_prefix(op_type))
        outs = [name] if n_out == 1 else [f"{name}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, **attrs))
        return outs

    def constant_node(self, array: np.ndarray) -> str:
        """A `Constant` node (exporter style) rather than an initializer."""
        name = self.fresh("constant")
        return self.op("Constant", [], name=name, value=numpy_helper.from_array(array, name))

    # ---- initializers ----------------------------------------------------------------------
    def param(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(array, order="C"), name))
        return name

    def weight(self, name: str, shape: Sequence[int], std: float) -> str:
        """Weights ~ U(-√3·std, √3·std): zero mean, standard deviation `std` (PyTorch's default
        kaiming-uniform style; five times faster to draw than normals for 100M-weight models)."""
        return self.uniform(name, shape, -math.sqrt(3.0) * std, math.sqrt(3.0) * std)

    def normal(self, name: str, shape: Sequence[int], std: float) -> str:
        if self.shapes_only:
            return self.input(name, shape)
        return self.param(name, self.rng.standard_normal(tuple(shape), dtype=np.float32) * std)

    def uniform(self, name: str, shape: Sequence[int], low: float, high: float) -> str:
        if self.shapes_only:
            return self.input(name, shape)
        values = self.rng.random(tuple(shape), dtype=np.float32)
        values *= np.float32(high - low)
        values += np.float32(low)
        return self.param(name, values)

    def scalar(self, value: float | int | bool, dtype: type = np.float32) -> str:
        """A 0-d constant initializer, shared by every user of the same value and dtype."""
        array = np.array(value, dtype=dtype)
        key = (array.dtype.str, array.tobytes())
        if key not in self._scalars:
            self._scalars[key] = self.param(self.fresh("scalar"), array)
        return self._scalars[key]

    def ints(self, values: Sequence[int]) -> str:
        """A 1-d int64 initializer (shapes, axes, slice bounds)."""
        return self.param(self.fresh("ints"), np.array(values, dtype=np.int64))

    def floats(self, values: Sequence[float]) -> str:
        return self.param(self.fresh("floats"), np.array(values, dtype=np.float32))

    # ---- graph interface -------------------------------------------------------------------
    def input(self, name: str, shape: Sequence[Dim] | None, dtype: int = TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, shape))
        return name

    def output(self, tensor: str, name: str, shape: Sequence[Dim] | None,
               dtype: int = TensorProto.FLOAT) -> str:
        """Expose `tensor` as graph output `name` (renamed wherever it is produced or used)."""
        for node in self.nodes:
            node.input[:] = [name if t == tensor else t for t in node.input]
            node.output[:] = [name if t == tensor else t for t in node.output]
        self.outputs.append(helper.make_tensor_value_info(name, dtype, shape))
        return name

    def graph(self) -> onnx.GraphProto:
        return helper.make_graph(
            self.nodes, self.name, self.inputs, self.outputs, self.initializers
        )

    def model(self, doc: str) -> onnx.ModelProto:
        opsets = [helper.make_opsetid("", self.opset)]
        model = helper.make_model(
            helper.make_graph([], self.name, [], []),
            opset_imports=opsets,
            ir_version=helper.find_min_ir_version_for(opsets),
            producer_name=PRODUCER,
            doc_string=doc,
        )
        # Filled in place: one copy of the weights instead of two (make_graph, then make_model).
        model.graph.node.extend(self.nodes)
        model.graph.input.extend(self.inputs)
        model.graph.output.extend(self.outputs)
        model.graph.initializer.extend(self.initializers)
        return model


# ---- layers shared by several models ---------------------------------------------------------
RELU_GAIN = math.sqrt(2.0)  # He et al. 2015: keeps the second moment through conv + ReLU
# E[gamma²] · E[1 / var] for gamma, var ~ U(0.5, 1.5): the mean square gain of an inference BN.
BN_GAIN2 = (13.0 / 12.0) * math.log(3.0)


def conv(b: GraphBuilder, x: str, cin: int, cout: int, k: int, *, stride: int = 1,
         group: int = 1, bias: bool = False, pad: int | None = None,
         gain: float = RELU_GAIN) -> str:
    """Conv2d, weights of std gain / √fan_in; `bias=False` when a BatchNormalization follows."""
    name = b.fresh("conv")
    fan_in = cin // group * k * k
    std = gain / math.sqrt(fan_in)
    inputs = [x, b.weight(f"{name}.weight", (cout, cin // group, k, k), std)]
    if bias:
        inputs.append(b.weight(f"{name}.bias", (cout,), 0.05))
    p = k // 2 if pad is None else pad
    return b.op("Conv", inputs, name=name, kernel_shape=[k, k], strides=[stride, stride],
                pads=[p, p, p, p], group=group)


def batch_norm(b: GraphBuilder, x: str, c: int, eps: float = 1e-5) -> str:
    """Inference BatchNormalization: gamma, var ~ U(0.5, 1.5); beta, mean ~ N(0, 0.1)."""
    name = b.fresh("bn")
    scale = b.uniform(f"{name}.weight", (c,), 0.5, 1.5)
    beta = b.normal(f"{name}.bias", (c,), 0.1)
    mean = b.normal(f"{name}.running_mean", (c,), 0.1)
    var = b.uniform(f"{name}.running_var", (c,), 0.5, 1.5)
    return b.op("BatchNormalization", [x, scale, beta, mean, var], name=name,
                epsilon=eps, momentum=0.9)


def conv_bn(b: GraphBuilder, x: str, cin: int, cout: int, k: int, *, stride: int = 1,
            group: int = 1, act: str | None = "Relu", gain: float = RELU_GAIN) -> str:
    """Conv (no bias) + explicit BatchNormalization (+ activation), as training exporters emit.

    The conv gain is divided by BN's mean gain so that the pair keeps activations O(1).
    """
    conv_gain = gain / math.sqrt(BN_GAIN2)
    y = conv(b, x, cin, cout, k, stride=stride, group=group, gain=conv_gain)
    y = batch_norm(b, y, cout)
    return b.op(act, [y]) if act else y


def linear(b: GraphBuilder, x: str, din: int, dout: int) -> str:
    """Exporter-style linear layer: MatMul by a [din, dout] weight, then Add of the bias."""
    name = b.fresh("matmul")
    y = b.op("MatMul", [x, b.weight(f"{name}.weight", (din, dout), 1.0 / math.sqrt(din))],
             name=name)
    add = b.fresh("add")
    return b.op("Add", [y, b.weight(f"{add}.bias", (dout,), 0.02)], name=add)


def gemm(b: GraphBuilder, x: str, din: int, dout: int) -> str:
    """Classifier head: Gemm with a [dout, din] weight (transB=1) and a bias."""
    name = b.fresh("gemm")
    w = b.weight(f"{name}.weight", (dout, din), 1.0 / math.sqrt(din))
    bias = b.weight(f"{name}.bias", (dout,), 0.02)
    return b.op("Gemm", [x, w, bias], name=name, alpha=1.0, beta=1.0, transB=1)


def gelu_erf(b: GraphBuilder, x: str) -> str:
    """Exact GELU as PyTorch exports it: x * 0.5 * (1 + erf(x / sqrt(2)))."""
    e = b.op("Erf", [b.op("Div", [x, b.scalar(math.sqrt(2.0))])])
    y = b.op("Mul", [x, b.op("Add", [e, b.scalar(1.0)])])
    return b.op("Mul", [y, b.scalar(0.5)])


def layer_norm(b: GraphBuilder, x: str, dim: int, eps: float = 1e-5) -> str:
    """The opset-17 `LayerNormalization` op over the last axis."""
    name = b.fresh("ln")
    scale = b.uniform(f"{name}.weight", (dim,), 0.5, 1.5)
    bias = b.normal(f"{name}.bias", (dim,), 0.1)
    return b.op("LayerNormalization", [x, scale, bias], name=name, axis=-1, epsilon=eps)


def unsqueeze(b: GraphBuilder, x: str, axes: Sequence[int]) -> str:
    """Unsqueeze with `axes` as an attribute before opset 13 and as an input from 13 on."""
    if b.opset < 13:
        return b.op("Unsqueeze", [x], axes=list(axes))
    return b.op("Unsqueeze", [x, b.ints(axes)])


def dim_of(b: GraphBuilder, shape: str, axis: int) -> str:
    """Shape → Gather(axis) → Unsqueeze: one dim as a 1-d tensor, as PyTorch exports `x.size(i)`."""
    return unsqueeze(b, b.op("Gather", [shape, b.scalar(axis, np.int64)], axis=0), [0])
