"""Strategy `greedy`: priority merging by predicted time saved, as XLA's priority fusion.

Problem: a fast heuristic that fuses what the cost model says pays, on graphs of 10,000 nodes.
Approach: start from singletons; every quotient edge A→B whose union is legal gets the priority

    saving(A, B) = time(A) + time(B) − time(A ∪ B)            (XLA: time unfused − time fused)

kept in a max-heap with lazy invalidation (a version per group). Pop the best positive saving,
skip it if stale or if merging would close a cycle in the quotient graph (another path A → C → … → B;
the search only visits groups whose smallest node id is below B's largest, since ids are
topological), merge, and re-score the merged group's edges. Stop when no positive saving is left.
Invariants: after every merge the groups partition the nodes and the quotient graph is acyclic;
ties break by the smallest node id, so the result is deterministic.
"""

from __future__ import annotations

import heapq
import time

from fusesearch.search.problem import SearchProblem, SolveResult


class _State:
    def __init__(self, problem: SearchProblem) -> None:
        graph = problem.graph
        self.problem = problem
        self.members: dict[int, frozenset[int]] = {i: frozenset({i}) for i in range(len(graph))}
        self.succ: dict[int, set[int]] = {i: set(graph.successors(i)) for i in range(len(graph))}
        self.pred: dict[int, set[int]] = {i: set(graph.predecessors(i)) for i in range(len(graph))}
        self.lo = {i: i for i in range(len(graph))}
        self.hi = {i: i for i in range(len(graph))}
        self.version = {i: 0 for i in range(len(graph))}
        self.heap: list[tuple[float, int, int, int, int, int]] = []
        self.merges = 0

    def push(self, a: int, b: int) -> None:
        union = self.members[a] | self.members[b]
        verdict = self.problem.legality.check(union)
        if not verdict.decision:
            return
        saving = self.problem.time_s(self.members[a]) + self.problem.time_s(self.members[b]) - verdict.time_s
        if saving > 0:
            heapq.heappush(self.heap, (-saving, min(self.lo[a], self.lo[b]), a, b, self.version[a], self.version[b]))

    def closes_cycle(self, a: int, b: int) -> bool:
        """Is there a path a → c → … → b through some other group c?"""
        limit = self.hi[b]
        stack = [c for c in self.succ[a] if c != b and self.lo[c] < limit]
        seen = set(stack)
        while stack:
            c = stack.pop()
            if b in self.succ[c]:
                return True
            for d in self.succ[c]:
                if d not in seen and d != b and self.lo[d] < limit:
                    seen.add(d)
                    stack.append(d)
        return False

    def merge(self, a: int, b: int) -> None:
        self.members[a] = self.members[a] | self.members.pop(b)
        self.lo[a], self.hi[a] = min(self.lo[a], self.lo.pop(b)), max(self.hi[a], self.hi.pop(b))
        for c in self.succ.pop(b):
            self.pred[c].discard(b)
            if c != a:
                self.pred[c].add(a)
                self.succ[a].add(c)
        for c in self.pred.pop(b):
            self.succ[c].discard(b)
            if c != a:
                self.succ[c].add(a)
                self.pred[a].add(c)
        self.succ[a].discard(b)
        self.pred[a].discard(b)
        self.version[a] += 1
        del self.version[b]
        self.merges += 1


def greedy_partition(problem: SearchProblem) -> list[frozenset[int]]:
    state = _State(problem)
    for a in sorted(state.succ):
        for b in sorted(state.succ[a]):
            state.push(a, b)
    while state.heap:
        _, _, a, b, va, vb = heapq.heappop(state.heap)
        if state.version.get(a) != va or state.version.get(b) != vb:
            continue
        if state.closes_cycle(a, b):
            continue
        state.merge(a, b)
        for p in sorted(state.pred[a]):
            state.push(p, a)
        for s in sorted(state.succ[a]):
            state.push(a, s)
    return sorted(state.members.values(), key=min)


class GreedySolver:
    name = "greedy"

    def solve(self, problem: SearchProblem, *, time_limit_s: float = 0.0, seed: int = 0) -> SolveResult:
        start = time.perf_counter()
        groups = tuple(greedy_partition(problem))
        return SolveResult(groups, "HEURISTIC", problem.partition_time_s(groups), None,
                           time.perf_counter() - start, {"evaluated_groups": problem.legality.evaluated})
