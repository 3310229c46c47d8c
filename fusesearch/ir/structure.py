"""A group's structure: what its lowering and cost depend on, without node ids or tensor names.

Problem: a transformer repeats one block tens of times; lowering and pricing every copy of every
candidate group again costs most of a deep graph's search.
Approach: `structure` (below) is a key equal for two groups exactly when lowering sees the same
ops, attributes, shapes, small constant values and internal wiring, and the same outputs read from
outside; `Structures` computes it for many groups of one graph, each node's and tensor's part read
once. Legality shares a verdict between groups of one structure; the unfused figures share a
single node's kernel.
Invariants: keys compare whole tuples (no hash collision merges two groups)."""

from __future__ import annotations

from collections.abc import Iterable

from fusesearch.ir.graph import Graph

SHAPE_LIKE = 16  # constants up to this size tell groups apart by value (shapes, axes); larger ones (weights) by shape


def structure(graph: Graph, nodes: frozenset[int]) -> tuple:
    """What a group's lowering and cost depend on, without node ids or tensor names: per node (in
    id order) its op, attributes, and for each input where it comes from (a member, by position
    and output, or an outside tensor, numbered by first use so that shared inputs stay shared,
    with its shape, dtype and, for constants of up to SHAPE_LIKE elements (shapes, axes, slice
    bounds, scalars: what lowering reads), value), and for each output its shape, dtype
    and whether anything outside the group (or the graph's output) reads it."""
    return Structures(graph)(nodes)


class Structures:
    """`structure` of many groups of one graph: each node's and tensor's part is read once."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._nodes: dict[int, tuple] = {}
        self._tensors: dict[str, tuple] = {}

    def __call__(self, nodes: Iterable[int]) -> tuple:
        order = sorted(nodes)
        position = {v: i for i, v in enumerate(order)}
        outside: dict[str, int] = {}
        out = []
        for v in order:
            head, inputs_of, outputs_of = self._node(v)
            inputs = []
            for t, producer, output in inputs_of:
                if producer in position:
                    inputs.append((position[producer], output))
                else:
                    inputs.append((outside.setdefault(t, len(outside)), *self._tensor(t)))
            outputs = tuple((info, read_outside or any(c not in position for c in consumers))
                            for info, read_outside, consumers in outputs_of)
            out.append((*head, tuple(inputs), outputs))
        return tuple(out)

    def _node(self, v: int) -> tuple:
        part = self._nodes.get(v)
        if part is None:
            graph, node = self.graph, self.graph.nodes[v]
            head = (node.op_type, node.domain, tuple(sorted((k, repr(a)) for k, a in node.attrs.items())))
            inputs = []
            for t in node.inputs:
                producer = graph.producer(t) if t else None
                inputs.append((t, producer, None if producer is None else graph.nodes[producer].outputs.index(t)))
            outputs = []
            for t in node.outputs:
                info = graph.info(t)
                outputs.append((None if info is None else (info.shape, info.dtype), graph.is_output(t),
                                graph.consumers(t)))
            part = self._nodes[v] = (head, tuple(inputs), tuple(outputs))
        return part

    def _tensor(self, t: str) -> tuple:
        part = self._tensors.get(t)
        if part is None:
            graph = self.graph
            info = graph.info(t) if t else None
            value = graph.constant_value(t) if t else None
            value = value if value is not None and value.size <= SHAPE_LIKE else None
            part = self._tensors[t] = (None if info is None else (info.shape, info.dtype, info.constant),
                                       None if value is None else (value.dtype.str, value.shape, value.tobytes()))
        return part
