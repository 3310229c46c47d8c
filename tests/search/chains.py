"""A deterministic synthetic chain of any length, built as a `Graph` directly (no ONNX file, no
loader): blocks of [MatMul → Add bias → Relu → Softmax → Add residual], every tensor [64, 256]
float32, the residual taken from the previous block's output. Used by the search's scale tests and
`benchmarks/bench_search.py`."""

from __future__ import annotations

from fusesearch.ir.graph import Graph, Node, TensorInfo
from fusesearch.ir.op_kind import kind_of

SHAPE = (64, 256)
BLOCK = ("MatMul", "Add", "Relu", "Softmax", "Add")  # the last Add joins the residual


def chain_graph(n: int) -> Graph:
    """n nodes (the last block cut short where n is not a multiple of len(BLOCK))."""
    tensors = {"x": TensorInfo("x", SHAPE, "float32"), "w": TensorInfo("w", (SHAPE[1], SHAPE[1]), "float32", True),
               "b": TensorInfo("b", (SHAPE[1],), "float32", True)}
    nodes, prev, residual = [], "x", "x"
    for i in range(n):
        position = i % len(BLOCK)
        op = BLOCK[position]
        inputs = {0: (prev, "w"), 1: (prev, "b"), 4: (prev, residual)}.get(position, (prev,))
        out = f"t{i}"
        nodes.append(Node(i, f"n{i}", op, "", kind_of(op), inputs, (out,), {"axis": -1} if op == "Softmax" else {}))
        tensors[out] = TensorInfo(out, SHAPE, "float32")
        prev = out
        if position == len(BLOCK) - 1:
            residual = out
    return Graph.build("chain", nodes, tensors, ["x"], [prev])
