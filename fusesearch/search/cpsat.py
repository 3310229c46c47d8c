"""Strategy `cpsat`: exact set partitioning over the candidates with OR-Tools CP-SAT.

Problem: choose, among the enumerated candidate groups, a partition of the nodes of least
predicted time whose quotient graph is acyclic — two convex groups can still form a cycle
(p→q, r→s, p→s, r→q with groups {p, s} and {r, q}).
Model (as the OR-Tools samples: data, model, variables, constraints, objective, solve, output):
  data         candidates g with cost c_g in integer nanoseconds (the only place ints are used)
  variables    x_g ∈ {0,1} per candidate; rank r_v ∈ [0, n-1] per node
  constraints  Σ_{g ∋ v} x_g = 1 for every node v                          (exact partition)
               for every edge u→v, with y_uv = Σ_{g ∋ u,v} x_g (1 iff u, v share the chosen group):
                 r_v − r_u + y_uv ≥ 1          (strictly later across groups)
                 r_v − r_u + n·y_uv ≤ n        (same rank inside a group)
               so ranks are equal inside a (connected) group and increase along every edge
               between groups: the quotient graph has a topological order, hence no cycle.
  objective    minimize Σ c_g x_g
  search       hinted with the greedy plan (and its quotient's topological ranks); time limit,
               seed and workers from the config; with few workers the `max_lp` and `core`
               subsolvers are added, which is what proves optimality on 2 cores; search is
               interleaved (deterministic for a given seed and worker count).
The candidate set always holds the rules and greedy groups, so the optimum is never worse than
either. On a time-out the best plan found is returned with its gap to the bound; if CP-SAT
found nothing the greedy plan is returned, never nothing.
Invariants: this is the only module that imports ortools.
"""

from __future__ import annotations

import logging
import time

from ortools.sat.python import cp_model

from fusesearch.candidates.enumerate import CandidateSet, enumerate_candidates
from fusesearch.search.greedy import greedy_partition
from fusesearch.search.problem import SearchProblem, SolveResult
from fusesearch.search.rules import rules_partition

log = logging.getLogger(__name__)

NS_PER_S = 1e9
FEW_WORKERS = 4


class CpSatSolver:
    name = "cpsat"

    def solve(self, problem: SearchProblem, *, time_limit_s: float, seed: int) -> SolveResult:
        start = time.perf_counter()
        greedy = greedy_partition(problem)
        rules = rules_partition(problem)
        candidates = enumerate_candidates(problem.legality, budget_per_seed=problem.config.budget_per_seed,
                                          extra=[*greedy, *rules])
        enumerated_s = time.perf_counter() - start
        remaining = max(1.0, time_limit_s - enumerated_s)
        result = _solve_model(problem, candidates, greedy, remaining, seed)
        stats = {**result.stats, "candidates": len(candidates), "enumeration_checks": candidates.checked,
                 "enumeration_s": round(enumerated_s, 3)}
        return SolveResult(result.groups, result.status, result.objective_s, result.bound_s,
                           time.perf_counter() - start, stats)


def _cost_ns(problem: SearchProblem, group: frozenset[int]) -> int:
    return max(0, round(problem.time_s(group) * NS_PER_S))


def _solve_model(problem: SearchProblem, candidates: CandidateSet, hint: list[frozenset[int]],
                 time_limit_s: float, seed: int) -> SolveResult:
    graph = problem.graph
    n = len(graph)
    model = cp_model.CpModel()
    x = [model.new_bool_var(f"x{i}") for i in range(len(candidates))]
    rank = [model.new_int_var(0, max(n - 1, 0), f"r{v}") for v in range(n)]
    containing = candidates.containing()
    for v in range(n):
        model.add_exactly_one(x[i] for i in containing[v])
    for u in range(n):
        shared_with = _pairs(candidates, containing[u])
        for v in graph.successors(u):
            together = sum(x[i] for i in shared_with.get(v, ()))
            model.add(rank[v] - rank[u] + together >= 1)
            if shared_with.get(v):
                model.add(rank[v] - rank[u] + n * together <= n)
    costs = [_cost_ns(problem, g) for g in candidates.groups]
    model.minimize(sum(c * xi for c, xi in zip(costs, x, strict=True)))
    _add_hint(model, candidates, x, rank, hint, graph)
    solver = cp_model.CpSolver()
    _configure(solver.parameters, problem.config.workers, time_limit_s, seed)
    status = solver.solve(model)
    return _result(problem, candidates, solver, status, x, hint)


def _pairs(candidates: CandidateSet, indices: list[int]) -> dict[int, list[int]]:
    """For node u: other node v → candidates containing both u and v."""
    out: dict[int, list[int]] = {}
    for i in indices:
        for v in candidates.groups[i]:
            out.setdefault(v, []).append(i)
    return out


def _add_hint(model, candidates, x, rank, hint, graph) -> None:
    index = {g: i for i, g in enumerate(candidates.groups)}
    chosen = {index[g] for g in hint if g in index}
    for i, var in enumerate(x):
        model.add_hint(var, i in chosen)
    for r, group in enumerate(_topological_groups(graph, hint)):
        for v in group:
            model.add_hint(rank[v], r)


def _topological_groups(graph, groups: list[frozenset[int]]) -> list[frozenset[int]]:
    from fusesearch.plans import order_groups

    return [groups[i] for i in order_groups(graph, groups)]


def _configure(params, workers: int, time_limit_s: float, seed: int) -> None:
    params.max_time_in_seconds = float(time_limit_s)
    params.num_workers = int(workers)
    params.random_seed = int(seed)
    params.interleave_search = True
    if workers <= FEW_WORKERS:
        params.extra_subsolvers.extend(["max_lp", "core"])


def _result(problem, candidates, solver, status, x, hint) -> SolveResult:
    name = solver.status_name(status)
    bound_s = solver.best_objective_bound / NS_PER_S if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
    stats = {"solver_status": name, "objective_ns": None, "conflicts": solver.num_conflicts,
             "branches": solver.num_branches, "solver_wall_s": round(solver.wall_time, 3)}
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        groups = tuple(g for g, var in zip(candidates.groups, x, strict=True) if solver.value(var))
        stats["objective_ns"] = int(solver.objective_value)
    else:
        log.warning("cpsat found no solution in time (%s); returning the greedy plan", name)
        groups, name = tuple(hint), "FEASIBLE"
        stats["fallback"] = "greedy"
    groups = tuple(sorted(groups, key=min))
    return SolveResult(groups, name, problem.partition_time_s(groups), bound_s, 0.0, stats)
