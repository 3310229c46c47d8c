"""Frozen analysis view of a canonical ONNX graph: nodes, tensors, producers, reachability.

Problem: enumeration, legality, costs and plan validation ask the same questions millions of times
(who produces or reads a tensor, does a reach b) and must not mutate the model while asking.
Approach: `ir._from_ir.graph_from_ir` copies an `onnx_ir.Model`'s main graph into frozen
dataclasses: nodes in topological order with ids 0..n-1, a `TensorInfo` per value, and per node
bitsets (Python ints) of its descendants and ancestors, one sweep each way:

    desc[i] = OR over successors j of (1 << j | desc[j])        O(edges) big-int ORs
    anc[i]  = OR over predecessors j of (1 << j | anc[j])

so `reaches(a, b)` is one shift-and-mask, and a group S is convex iff (OR desc) & (OR anc) & ~S
== 0, O(|S|) big-int ops.
Invariants: node ids equal positions in topological order; every edge goes from a lower to a
higher id; the view never changes after construction (transforms build a new Graph)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any

import numpy as np

from fusesearch.ir.op_kind import OpKind
from fusesearch.ir.tensor import TensorInfo

SMALL_CONSTANT = 4096  # constants up to this many elements keep their values in the view

@dataclass(frozen=True, eq=False)
class Node:
    """One operator. `inputs` / `outputs` are tensor names ('' for an omitted optional input)."""

    id: int
    name: str
    op_type: str
    domain: str
    kind: OpKind
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any]

    def __repr__(self) -> str:
        return f"Node({self.id}, {self.name!r}, {self.op_type})"


@dataclass(frozen=True, eq=False)
class Graph:
    name: str
    nodes: tuple[Node, ...]
    tensors: Mapping[str, TensorInfo]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    _producer: Mapping[str, int] = field(repr=False)
    _consumers: Mapping[str, tuple[int, ...]] = field(repr=False)
    _desc: tuple[int, ...] = field(repr=False)
    _anc: tuple[int, ...] = field(repr=False)
    _small_constants: Mapping[str, np.ndarray] = field(repr=False, default_factory=dict)
    # float32 GEMMs and convs may run on TF32 tensor cores (ONNX Runtime's CUDA default; --no-tf32
    # turns it off): a property of how the graph is compiled, which lowering reads
    allow_tf32: bool = True

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def build(cls, name: str, nodes: Iterable[Node], tensors: Mapping[str, TensorInfo],
              inputs: Iterable[str], outputs: Iterable[str],
              small_constants: Mapping[str, np.ndarray] | None = None) -> Graph:
        nodes = tuple(nodes)
        producer: dict[str, int] = {}
        consumers: dict[str, list[int]] = {}
        for node in nodes:
            for t in node.outputs:
                if t:
                    producer[t] = node.id
        for node in nodes:
            for t in dict.fromkeys(node.inputs):
                if t:
                    consumers.setdefault(t, []).append(node.id)
        desc, anc = _closures(nodes, producer)
        return cls(name, nodes, MappingProxyType(dict(tensors)), tuple(inputs), tuple(outputs),
                   MappingProxyType(producer), MappingProxyType({k: tuple(v) for k, v in consumers.items()}),
                   desc, anc, MappingProxyType(dict(small_constants or {})))

    # -- queries --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.nodes)

    def node(self, key: int | str) -> Node:
        return self.nodes[key] if isinstance(key, int) else self.nodes[self._by_name[key]]

    @cached_property
    def _by_name(self) -> Mapping[str, int]:
        return {n.name: n.id for n in self.nodes}

    def producer(self, tensor: str) -> int | None:
        """Id of the node writing `tensor`; None for graph inputs and constants."""
        return self._producer.get(tensor)

    def consumers(self, tensor: str) -> tuple[int, ...]:
        return self._consumers.get(tensor, ())

    def successors(self, node_id: int) -> tuple[int, ...]:
        return tuple(sorted({c for t in self.nodes[node_id].outputs for c in self.consumers(t)}))

    def predecessors(self, node_id: int) -> tuple[int, ...]:
        found = {self._producer[t] for t in self.nodes[node_id].inputs if t in self._producer}
        return tuple(sorted(found))

    def descendants(self, node_id: int) -> int:
        """Bitset of nodes reachable from `node_id` (excluding itself)."""
        return self._desc[node_id]

    def ancestors(self, node_id: int) -> int:
        """Bitset of nodes from which `node_id` is reachable (excluding itself)."""
        return self._anc[node_id]

    def reaches(self, a: int, b: int) -> bool:
        """True when a path of one or more edges leads from node a to node b."""
        return bool(self._desc[a] >> b & 1)

    def is_convex(self, group: Iterable[int]) -> bool:
        """No path leaves the group and comes back: desc(S) ∩ anc(S) ⊆ S."""
        members = desc = anc = 0
        for i in group:
            members |= 1 << i
            desc |= self._desc[i]
            anc |= self._anc[i]
        return not (desc & anc & ~members)

    def is_output(self, tensor: str) -> bool:
        return tensor in self._outputs_set

    @cached_property
    def _outputs_set(self) -> frozenset[str]:
        return frozenset(self.outputs)

    def constant_value(self, tensor: str) -> np.ndarray | None:
        """Value of a small constant (axes, shapes, scalars: up to SMALL_CONSTANT elements)."""
        return self._small_constants.get(tensor)

    def info(self, tensor: str) -> TensorInfo | None:
        return self.tensors.get(tensor) if tensor else None

    def node_inputs(self, node: Node) -> list[TensorInfo | None]:
        return [self.info(t) for t in node.inputs]

    def node_outputs(self, node: Node) -> list[TensorInfo | None]:
        return [self.info(t) for t in node.outputs]


def _closures(nodes: tuple[Node, ...], producer: Mapping[str, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Descendant and ancestor bitsets of every node, one sweep each."""
    succ: list[set[int]] = [set() for _ in nodes]
    pred: list[set[int]] = [set() for _ in nodes]
    for node in nodes:
        for t in node.inputs:
            p = producer.get(t)
            if p is not None:
                if p >= node.id:
                    raise ValueError(f"node {node.name} reads {t} from a later node: not topological")
                succ[p].add(node.id)
                pred[node.id].add(p)
    desc = [0] * len(nodes)
    for i in range(len(nodes) - 1, -1, -1):
        acc = 0
        for j in succ[i]:
            acc |= (1 << j) | desc[j]
        desc[i] = acc
    anc = [0] * len(nodes)
    for i in range(len(nodes)):
        acc = 0
        for j in pred[i]:
            acc |= (1 << j) | anc[j]
        anc[i] = acc
    return tuple(desc), tuple(anc)
