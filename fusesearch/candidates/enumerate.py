"""Enumerate candidate fusion groups: connected, convex node sets that the legality rules accept.

Problem: the exact solver chooses among candidates, so the set must hold the groups worth
choosing, without blowing up on 10,000-node graphs (connected subsets grow exponentially).
Approach: from each seed node s, a breadth-first growth over undirected neighbours with ids > s
(so every connected set is produced only from its smallest node, as in the ESU algorithm).
Each grown set is closed to its convex hull — the nodes on paths between members,
(OR desc) & (OR anc) from the Graph's bitsets; such nodes have ids between the members', so the
seed stays the minimum — and kept only if legal; only legal sets grow further. A budget of legality
checks per seed bounds the work (small groups come first, as BFS goes by size). Every single
node is a candidate; `extra` groups (those the rules and greedy strategies formed) are added so
the exact solver can always reproduce them. `blocked_only_candidates`: groups with a blocked form
alone (`schedule.anchor_chain`), found from each anchor (the growth stops at a second one).
Invariants: groups are distinct, connected, convex and legal (in NCHW, or in the blocked layout
alone); the order is deterministic (by smallest node, size, then node ids).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from fusesearch.candidates.rules import Legality
from fusesearch.ir.graph import Graph
from fusesearch.ir.op_kind import OpKind

DEFAULT_BUDGET_PER_SEED = 48


@dataclass(frozen=True)
class CandidateSet:
    groups: tuple[frozenset[int], ...]
    checked: int  # legality checks made (the enumeration's work)

    def __len__(self) -> int:
        return len(self.groups)

    def containing(self) -> list[list[int]]:
        """For each node id, the indices of the candidates that contain it."""
        n = 1 + max((max(g) for g in self.groups), default=-1)
        out: list[list[int]] = [[] for _ in range(n)]
        for i, g in enumerate(self.groups):
            for v in g:
                out[v].append(i)
        return out


def neighbours(graph: Graph) -> list[tuple[int, ...]]:
    return [tuple(sorted(set(graph.predecessors(i)) | set(graph.successors(i)))) for i in range(len(graph))]


def convex_hull(graph: Graph, nodes: Iterable[int], limit: int | None = None) -> frozenset[int] | None:
    """The nodes on paths between `nodes`, or None when there are more than `limit` of them."""
    members = desc = anc = 0
    for i in nodes:
        members |= 1 << i
        desc |= graph.descendants(i)
        anc |= graph.ancestors(i)
    hull = members | (desc & anc)
    if limit is not None and hull.bit_count() > limit:
        return None
    return frozenset(_bits(hull))


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def enumerate_candidates(legality: Legality, *, budget_per_seed: int = DEFAULT_BUDGET_PER_SEED,
                         extra: Iterable[frozenset[int]] = ()) -> CandidateSet:
    graph = legality.graph
    nbrs = neighbours(graph)
    found: set[frozenset[int]] = set()
    checked = 0
    for seed in range(len(graph)):
        found.add(frozenset({seed}))
        if graph.nodes[seed].kind != OpKind.OPAQUE:
            checked += _grow(legality, graph, nbrs, seed, budget_per_seed, found)
    for group in extra:
        group = frozenset(group)
        if group not in found and legality.outcome(group).decision:
            found.add(group)
    ordered = sorted(found, key=lambda g: (min(g), len(g), sorted(g)))
    return CandidateSet(tuple(ordered), checked)


def _grow(legality: Legality, graph: Graph, nbrs: list[tuple[int, ...]], seed: int, budget: int,
          found: set[frozenset[int]]) -> int:
    frontier = deque([frozenset({seed})])
    seen = {frontier[0]}
    checks = 0
    while frontier and checks < budget:
        group = frontier.popleft()
        for nb in sorted({j for i in group for j in nbrs[i]} - group):
            if nb < seed or graph.nodes[nb].kind == OpKind.OPAQUE:
                continue
            grown = convex_hull(graph, group | {nb}, legality.max_group_size)
            if grown is None or grown in seen:
                continue
            seen.add(grown)
            checks += 1
            if legality.outcome(grown).decision:
                found.add(grown)
                frontier.append(grown)
            if checks >= budget:
                break
    return checks


CHAIN_REACH = 4  # ops between a depthwise conv and the conv before it, and after it, at most


def blocked_only_candidates(legality: Legality) -> tuple[frozenset[int], ...]:
    """The groups legal in the blocked layout alone (`Legality.blocked_only`), where plans may
    choose layouts: for each anchor, each anchor up to CHAIN_REACH ops above it with the ops on
    the paths between them (the convex hull), and that with each run of single consumers after
    it (its activation), CHAIN_REACH at most; in the enumeration's order."""
    graph = legality.graph
    if not legality.layout.blocked:
        return ()
    found: set[frozenset[int]] = set()
    for second in (n for n in graph.nodes if n.kind == OpKind.ANCHOR):
        for first in _anchors_above(graph, second.id):
            core = convex_hull(graph, {first, second.id}, legality.max_group_size)
            for group in (core, *_tails(graph, core, second.id, legality.max_group_size)) if core else ():
                if legality.blocked_only(group):
                    found.add(group)
    return tuple(sorted(found, key=lambda g: (min(g), len(g), sorted(g))))


def _anchors_above(graph: Graph, node: int) -> list[int]:
    """The anchors within CHAIN_REACH ops above `node` through ops that are no anchors."""
    out, frontier = [], [node]
    for _ in range(CHAIN_REACH):
        frontier = sorted({p for i in frontier for p in graph.predecessors(i)})
        out += [p for p in frontier if graph.nodes[p].kind == OpKind.ANCHOR]
        frontier = [p for p in frontier if graph.nodes[p].kind != OpKind.ANCHOR]
    return sorted(set(out))


def _tails(graph: Graph, core: frozenset[int], last: int, limit: int) -> list[frozenset[int]]:
    """`core` grown by the run of single consumers after node `last` (one op, then two...), ops
    that are no anchors."""
    out, group, node = [], core, last
    for _ in range(CHAIN_REACH):
        consumers = graph.successors(node)
        if (len(consumers) != 1 or graph.nodes[consumers[0]].kind not in (OpKind.ELEMWISE, OpKind.BROADCAST)
                or len(group) >= limit):
            break
        node = consumers[0]
        group = group | {node}
        out.append(group)
    return out
