"""Copy the main graph of an `onnx_ir.Model` into the frozen `Graph` view.

Problem: the analysis view must not depend on onnx-ir's mutable objects, and control-flow nodes
read outer-scope values inside their bodies without listing them as inputs.
Approach: one pass in topological order; each node's inputs are its explicit inputs followed by
the outer-scope values its subgraphs capture (so reachability and convexity see those edges);
attributes become plain Python values (tensors as numpy arrays, subgraphs kept opaque).
Invariants: node ids follow the IR's (topological) order; tensor names are the model's.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from fusesearch.ir.graph import SMALL_CONSTANT, Graph, Node
from fusesearch.ir.op_kind import kind_of
from fusesearch.ir.tensor import TensorInfo


def dtype_name(dtype: ir.DataType | None) -> str:
    if dtype is None:
        return "unknown"
    try:
        return str(dtype.numpy().name)
    except (TypeError, ValueError, AttributeError):
        return dtype.name.lower()


def _static(value: ir.Value) -> tuple[int, ...] | None:
    if value.shape is None:
        return None
    dims = tuple(value.shape)
    return tuple(int(d) for d in dims) if all(isinstance(d, int) for d in dims) else None


def tensor_info(value: ir.Value) -> TensorInfo:
    return TensorInfo(value.name or "", _static(value), dtype_name(value.dtype),
                      constant=value.const_value is not None)


def attr_value(attr: ir.Attr) -> Any:
    kind = attr.type
    if kind == ir.AttributeType.TENSOR:
        return attr.value.numpy()
    if kind in (ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS):
        return tuple(attr.value)
    return attr.value


def captured_values(node: ir.Node) -> list[ir.Value]:
    """Outer-scope values read inside the node's subgraphs (If/Loop/Scan bodies)."""
    found: dict[int, ir.Value] = {}
    for attr in node.attributes.values():
        graphs = []
        if attr.type == ir.AttributeType.GRAPH:
            graphs = [attr.value]
        elif attr.type == ir.AttributeType.GRAPHS:
            graphs = list(attr.value)
        for sub in graphs:
            _collect_captured(sub, found)
    return list(found.values())


def _collect_captured(sub: ir.Graph, found: dict[int, ir.Value]) -> None:
    local = {id(v) for v in sub.inputs} | {id(v) for v in sub.initializers.values()}
    for inner in sub:
        local |= {id(o) for o in inner.outputs}
    for inner in sub:
        for v in inner.inputs:
            if v is not None and id(v) not in local:
                found.setdefault(id(v), v)
        for v in captured_values(inner):
            if id(v) not in local:
                found.setdefault(id(v), v)


def graph_from_ir(model: ir.Model) -> Graph:
    g = model.graph
    tensors: dict[str, TensorInfo] = {}
    small: dict = {}

    def note(value: ir.Value | None) -> str:
        if value is None:
            return ""
        if value.name not in tensors:
            info = tensors[value.name] = tensor_info(value)
            if info.constant and info.shape is not None and info.size <= SMALL_CONSTANT:
                small[value.name] = value.const_value.numpy().copy()
        return value.name

    for v in g.inputs:
        note(v)
    for v in g.initializers.values():
        note(v)
    nodes = []
    for i, n in enumerate(g):
        inputs = tuple(note(v) for v in n.inputs) + tuple(note(v) for v in captured_values(n))
        outputs = tuple(note(v) for v in n.outputs)
        attrs = {name: attr_value(a) for name, a in n.attributes.items()}
        nodes.append(Node(i, n.name or f"{n.op_type.lower()}_{i}", n.op_type, n.domain or "",
                          kind_of(n.op_type, n.domain or ""), inputs, outputs, attrs))
    outputs = tuple(note(v) for v in g.outputs)
    return Graph.build(g.name or "graph", nodes, tensors, [v.name for v in g.inputs], outputs, small)
