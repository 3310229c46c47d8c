"""Strategy `rules`: the classic fixed patterns of OpenPPL and ONNX Runtime — the baseline.

Problem: researchers compare against what production runtimes do today.
Approach: one pass in topological order; each anchor not yet taken tries, longest first:

    Conv  [+ Add (residual)] [+ activation]        activation ∈ Relu, Clip, LeakyRelu,
    ConvTranspose [+ activation]                               Sigmoid, HardSwish
    Gemm  [+ activation]
    MatMul [+ Add (constant bias)] [+ activation]

A link is taken only when the tensor between has one consumer and is no graph output (ONNX
Runtime's condition) and the group passes the common legality rules (else cut to its longest legal
prefix).
Invariants: groups are disjoint; every node not in a pattern stays alone."""

from __future__ import annotations

import time

from fusesearch.ir.graph import Graph, Node
from fusesearch.search.problem import SearchProblem, SolveResult

ACTIVATIONS = frozenset({"Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSwish"})
ANCHORS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})


def _sole_consumer(graph: Graph, node: Node) -> Node | None:
    out = node.outputs[0]
    users = graph.consumers(out)
    if len(users) != 1 or graph.is_output(out) or len(node.outputs) != 1:
        return None
    return graph.nodes[users[0]]


def _pattern(graph: Graph, anchor: Node) -> list[int]:
    chain = [anchor.id]
    nxt = _sole_consumer(graph, anchor)
    if nxt is not None and nxt.op_type == "Add" and _add_allowed(graph, anchor, nxt):
        chain.append(nxt.id)
        nxt = _sole_consumer(graph, nxt)
    if nxt is not None and nxt.op_type in ACTIVATIONS:
        chain.append(nxt.id)
    return chain


def _add_allowed(graph: Graph, anchor: Node, add: Node) -> bool:
    if anchor.op_type == "Conv":
        return True  # residual or bias: either operand
    if anchor.op_type == "MatMul":
        other = [t for t in add.inputs if t != anchor.outputs[0]]
        return bool(other) and all(graph.tensors[t].constant for t in other)
    return False


def rules_partition(problem: SearchProblem) -> list[frozenset[int]]:
    graph = problem.graph
    taken: set[int] = set()
    groups: list[frozenset[int]] = []
    for node in graph.nodes:
        if node.id in taken or node.op_type not in ANCHORS:
            continue
        chain = _pattern(graph, node)
        cut = next((k for k, i in enumerate(chain) if i in taken), len(chain))
        chain = chain[:cut]
        while len(chain) > 1 and not problem.legality.outcome(chain).decision:
            chain.pop()
        groups.append(frozenset(chain))
        taken.update(chain)
    groups.extend(frozenset({n.id}) for n in graph.nodes if n.id not in taken)
    return sorted(groups, key=min)


class RulesSolver:
    name = "rules"

    def solve(self, problem: SearchProblem, *, time_limit_s: float = 0.0, seed: int = 0) -> SolveResult:
        start = time.perf_counter()
        groups = tuple(rules_partition(problem))
        return SolveResult(groups, "HEURISTIC", problem.partition_time_s(groups), None,
                           time.perf_counter() - start)
