"""The two values every layer above the graph passes around: `FusionGroup` (a set of graph nodes
proposed to run as one kernel) and `FusionDecision` (a verdict with its reason).

Problem: enumeration, legality, lowering, costing, the solvers, plans and the backends all take or
return these, so they must sit below every one of them: importing this module imports no other
fusesearch module (tests/test_structure.py holds it to that).
Approach: two frozen dataclasses. A group is a frozen set of node ids (the Graph's topological
ids), the anchor node if it has one (Conv/ConvTranspose/MatMul/Gemm) and the name of the rule that
proposed it. A decision is ok or not, with a reason, as onnxscript's rewriter returns a failed
check's reason.
Invariants: a group's `nodes` is non-empty and its `anchor`, when set, a member; groups are
hashable and compare by (nodes, anchor, rule). A refused decision always has a non-empty reason;
a decision is truthy exactly when accepted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FusionDecision:
    ok: bool
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.ok and not self.reason:
            raise ValueError("a refused FusionDecision needs a reason")

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def accept(cls, reason: str = "") -> FusionDecision:
        return cls(True, reason)

    @classmethod
    def refuse(cls, reason: str) -> FusionDecision:
        return cls(False, reason)


@dataclass(frozen=True, order=False)
class FusionGroup:
    nodes: frozenset[int]
    anchor: int | None = None
    rule: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", frozenset(self.nodes))
        if not self.nodes:
            raise ValueError("a FusionGroup needs at least one node")
        if self.anchor is not None and self.anchor not in self.nodes:
            raise ValueError(f"anchor {self.anchor} is not a member of {sorted(self.nodes)}")

    @classmethod
    def single(cls, node_id: int) -> FusionGroup:
        return cls(frozenset({node_id}), None, "single")

    @property
    def sorted_nodes(self) -> tuple[int, ...]:
        return tuple(sorted(self.nodes))

    def __len__(self) -> int:
        return len(self.nodes)
