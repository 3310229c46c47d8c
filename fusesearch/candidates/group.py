"""`FusionGroup`: a set of graph nodes proposed to run as one kernel.

Problem: enumeration, lowering, solvers and plans pass groups around by value and compare them.
Approach: a frozen set of node ids (the Graph's topological ids), the anchor node if the group
has one (Conv/ConvTranspose/MatMul/Gemm), and the name of the rule that proposed it.
Invariants: `nodes` is non-empty; `anchor`, when set, is a member; groups are hashable and
compare by (nodes, anchor, rule).
"""

from __future__ import annotations

from dataclasses import dataclass


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
