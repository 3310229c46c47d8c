"""Split the exact search at cuts no candidate crosses, and find the pieces that are the same problem.

Problem: CP-SAT's time grows much faster than the graph, and a transformer is a chain of identical
blocks.
Approach: node ids are a topological order; at a cut k the few candidates crossing it, pairwise
overlapping, give its states (one of them, or none). `split` takes cuts left to right (at most
MAX_STATES, crossing no earlier cut); each piece and pair of states is a subproblem, and a dynamic
program (`join`): f_j(s) = min_r f_{j-1}(r) + opt(piece j | r, s) + cost(s). The joined plan is the
exact optimum when it is acyclic (checked whole: a quotient cycle can pass through a crossing
group). Subproblems keyed by signature (op types, attributes, shapes, dtypes, edges, local
candidates with costs, removed nodes) are solved once and shifted onto equal ones.
Invariants: pieces are contiguous, in order, cover 0..n-1; every candidate lies inside one piece
or crosses exactly one cut; keys compare whole tuples (no hash collision merges two problems)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fusesearch.ir.graph import Graph

MAX_STATES = 8  # crossing candidates a cut may have: (states + 1)² subproblems per piece at most


@dataclass(frozen=True)
class Chain:
    """Pieces [bounds[i], bounds[i+1]), their own candidates, and each inner cut's crossing ones."""

    bounds: tuple[int, ...]
    inside: tuple[tuple[int, ...], ...]  # per piece: indices of the candidates within it
    crossing: tuple[tuple[int, ...], ...]  # per cut bounds[1:-1]: candidates crossing it

    @property
    def pieces(self) -> int:
        return len(self.inside)


def split(n: int, groups: Sequence[frozenset[int]], max_states: int = MAX_STATES) -> Chain:
    """Cut the node order wherever the crossing candidates allow an exact join (module docstring)."""
    starts: list[list[int]] = [[] for _ in range(n + 1)]  # candidates that begin crossing at k
    for i, g in enumerate(groups):
        lo, hi = min(g), max(g)
        if hi > lo:
            starts[lo + 1].append(i)
    cuts, crossing = [], []
    active: list[int] = []
    prev = 0
    for k in range(1, n):
        active = [i for i in active if max(groups[i]) >= k] + starts[k]
        if len(active) > max_states or any(min(groups[i]) < prev for i in active):
            continue
        if all(not groups[a].isdisjoint(groups[b]) for j, a in enumerate(active) for b in active[j + 1:]):
            cuts.append(k)
            crossing.append(tuple(active))
            prev = k
    bounds = (0, *cuts, n)
    crossing_any = {i for c in crossing for i in c}
    inside: list[list[int]] = [[] for _ in range(len(bounds) - 1)]
    piece_of = [0] * n
    for p in range(len(bounds) - 1):
        piece_of[bounds[p]:bounds[p + 1]] = [p] * (bounds[p + 1] - bounds[p])
    for i, g in enumerate(groups):
        if i not in crossing_any:
            inside[piece_of[min(g)]].append(i)
    return Chain(bounds, tuple(map(tuple, inside)), tuple(crossing))


@dataclass(frozen=True)
class Subproblem:
    """Piece `piece` without the nodes of the candidates chosen at its cuts (`left`, `right`)."""

    piece: int
    left: int | None
    right: int | None
    start: int
    stop: int
    removed: frozenset[int]  # the piece's nodes in the cut states' candidates
    key: tuple

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(v for v in range(self.start, self.stop) if v not in self.removed)

    def candidates(self, chain: Chain, groups: Sequence[frozenset[int]]) -> tuple[int, ...]:
        """The piece's own candidates that keep clear of the removed nodes."""
        return tuple(i for i in chain.inside[self.piece] if groups[i].isdisjoint(self.removed))


@dataclass(frozen=True)
class Solution:
    """A subproblem's plan in piece-local node ids, its cost and lower bound (solver units)."""

    groups: tuple[tuple[int, ...], ...]
    value: int
    bound: int
    optimal: bool


def subproblems(graph: Graph, chain: Chain, groups: Sequence[frozenset[int]],
                costs: Sequence[int]) -> list[Subproblem]:
    """Every (piece, left state, right state) whose states share no node, in chain order."""
    out = []
    for p in range(chain.pieces):
        start, stop = chain.bounds[p], chain.bounds[p + 1]
        sig = signature(graph, start, stop, [groups[i] for i in chain.inside[p]],
                        [costs[i] for i in chain.inside[p]])
        lefts = (None, *chain.crossing[p - 1]) if p else (None,)
        rights = (None, *chain.crossing[p]) if p < chain.pieces - 1 else (None,)
        for left in lefts:
            for right in rights:
                if left is not None and right is not None and not groups[left].isdisjoint(groups[right]):
                    continue
                removed = frozenset(v for v in _nodes(groups, left) | _nodes(groups, right) if start <= v < stop)
                local = tuple(sorted(v - start for v in removed))
                out.append(Subproblem(p, left, right, start, stop, removed, (sig, local)))
    return out


def _nodes(groups: Sequence[frozenset[int]], index: int | None) -> frozenset[int]:
    return frozenset() if index is None else groups[index]


def join(chain: Chain, groups: Sequence[frozenset[int]], costs: Sequence[int], subs: Sequence[Subproblem],
         solved: Callable[[Subproblem], Solution]) -> tuple[list[frozenset[int]], int, int, bool]:
    """The least-cost choice of states over the chain: (plan, its cost, a lower bound of the whole
    optimum, whether every subproblem it rests on was solved to optimality)."""
    by_piece: dict[int, list[Subproblem]] = {}
    for sub in subs:
        by_piece.setdefault(sub.piece, []).append(sub)
    # state at the previous cut → (cost so far, the choices so far as a linked list (earlier, subproblem))
    best: dict[int | None, tuple[int, tuple | None]] = {None: (0, None)}
    bounds: dict[int | None, int] = {None: 0}
    proven = True
    for p in range(chain.pieces):
        nxt: dict[int | None, tuple[int, tuple | None]] = {}
        nxt_bounds: dict[int | None, int] = {}
        for sub in by_piece[p]:
            if sub.left not in best:
                continue
            sol = solved(sub)
            proven &= sol.optimal
            extra = costs[sub.right] if sub.right is not None else 0
            value = best[sub.left][0] + sol.value + extra
            if sub.right not in nxt or value < nxt[sub.right][0]:
                nxt[sub.right] = (value, (best[sub.left][1], sub))
            bound = bounds[sub.left] + sol.bound + extra
            nxt_bounds[sub.right] = min(bound, nxt_bounds.get(sub.right, bound))
        best, bounds = nxt, nxt_bounds
    value, chosen = best[None]
    return _plan(chosen, groups, solved), value, bounds[None], proven


def _plan(chosen: tuple | None, groups: Sequence[frozenset[int]],
          solved: Callable[[Subproblem], Solution]) -> list[frozenset[int]]:
    """The plan of the chosen subproblems (kept as a linked list, no copy per state and piece), each
    one's groups shifted onto its piece and followed by its right state's candidate, in chain order."""
    subs = []
    while chosen is not None:
        chosen, sub = chosen
        subs.append(sub)
    plan = []
    for sub in reversed(subs):
        plan += [frozenset(sub.start + v for v in g) for g in solved(sub).groups]
        if sub.right is not None:
            plan.append(groups[sub.right])
    return plan


def signature(graph: Graph, start: int, stop: int, groups: Sequence[frozenset[int]],
              costs: Sequence[int]) -> tuple:
    """Everything a piece's optimisation problem depends on, in piece-local node ids."""
    nodes = []
    for v in range(start, stop):
        node = graph.nodes[v]
        sources = tuple(_source(graph, t, start) for t in node.inputs)
        shapes = tuple(_shape(graph, t) for t in (*node.inputs, *node.outputs))
        attrs = tuple(sorted((k, repr(a)) for k, a in node.attrs.items()))
        nodes.append((node.op_type, node.domain, node.kind, attrs, sources, shapes))
    local = tuple((tuple(sorted(v - start for v in g)), c) for g, c in zip(groups, costs, strict=True))
    return (tuple(nodes), local)


def _source(graph: Graph, tensor: str, start: int) -> int | str:
    """Where a node input comes from: a node of the piece (local id), or outside (its kind)."""
    producer = graph.producer(tensor) if tensor else None
    if producer is not None and producer >= start:
        return producer - start
    return "outside" if producer is not None else ("missing" if not tensor else "input")


def _shape(graph: Graph, tensor: str):
    info = graph.info(tensor) if tensor else None
    return None if info is None else (info.shape, info.dtype, info.constant)
