"""Strategy `cpsat`: exact set partitioning over the candidates with OR-Tools CP-SAT.

Problem: choose, among the enumerated candidate groups, a partition of the nodes of least
predicted time whose quotient graph is acyclic — two convex groups can still form a cycle
(p→q, r→s, p→s, r→q with groups {p, s} and {r, q}).
Model (as the OR-Tools samples: data, model, variables, constraints, objective, solve, output):
  data         candidates g with cost c_g in integer picoseconds (the only place ints are used),
               or in a coarser unit where their sum would pass MAX_OBJECTIVE (huge shapes): CP-SAT
               refuses an objective that may overflow int64 (MODEL_INVALID)
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
               subsolvers are added, which is what proves optimality on 2 cores.
  determinism  parallel workers may prove the optimum with different, equally fast plans; a
               second solve with one (deterministic) worker, Σ c_g x_g ≤ optimum added and the same
               greedy hint, returns the same plan on every run (a time-limited FEASIBLE result
               may still differ between runs). The optimum is summed in integers from the chosen
               x_g, never read from CP-SAT's float objective (which can fall just below it), so
               the re-solve is always feasible; its status is the `resolve_status` statistic.
The candidate set always holds the rules and greedy groups, so the optimum is never worse than
either. On a time-out the best plan found is returned with its gap to the bound; if CP-SAT
found nothing in time the greedy plan is returned, never nothing. A model CP-SAT calls invalid
(or infeasible) is a bug, never read as a time-out: an internal error saying what CP-SAT found.
Invariants: this is the only module that imports ortools.
"""

from __future__ import annotations

import logging
import math
import time

from ortools.sat.python import cp_model

from fusesearch.candidates.enumerate import CandidateSet, enumerate_candidates
from fusesearch.errors import FusesearchError
from fusesearch.search.greedy import greedy_partition
from fusesearch.search.problem import SearchProblem, SolveResult
from fusesearch.search.rules import rules_partition

log = logging.getLogger(__name__)

PS_PER_S = 1e12
MAX_OBJECTIVE = 1 << 53  # Σ of all candidates' costs in solver units: int64-safe, exact in CP-SAT's doubles
CANONICAL_DETERMINISTIC_TIME = 60.0  # CP-SAT's deterministic time units (~seconds), one worker
MIN_SOLVE_S = 1.0  # CP-SAT always gets this long, even past the deadline (the hint is a plan)
SAFETY_S = 0.5  # reading the solution back ...
SAFETY_PER_NODE_S = 2e-4  # ... and building the validated plan (costs, unfused figures) after it
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
        result = _solve_model(problem, candidates, greedy, start + time_limit_s, seed)
        stats = {**result.stats, "candidates": len(candidates), "enumeration_checks": candidates.checked,
                 "enumeration_s": round(enumerated_s, 3)}
        return SolveResult(result.groups, result.status, result.objective_s, result.bound_s,
                           time.perf_counter() - start, stats)


def _costs(problem: SearchProblem, groups: tuple[frozenset[int], ...]) -> tuple[list[int], int]:
    """Integer costs in units of `unit` picoseconds: 1 ps, or as coarse as keeps their sum within
    MAX_OBJECTIVE (a model at huge dims costs up to 1e18 ps per candidate)."""
    ps = [problem.time_s(g) * PS_PER_S for g in groups]
    unit = max(1, math.ceil(sum(ps) / MAX_OBJECTIVE))
    return [round(t / unit) for t in ps], unit


def _solve_model(problem: SearchProblem, candidates: CandidateSet, hint: list[frozenset[int]],
                 deadline: float, seed: int) -> SolveResult:
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
    costs, unit = _costs(problem, candidates.groups)
    objective = sum(c * xi for c, xi in zip(costs, x, strict=True))
    model.minimize(objective)
    _add_hint(model, candidates, x, rank, hint, graph)
    solver = cp_model.CpSolver()
    remaining = max(MIN_SOLVE_S, deadline - time.perf_counter() - SAFETY_S - SAFETY_PER_NODE_S * n)
    _configure(solver.parameters, problem.config.workers, remaining, seed)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.UNKNOWN):  # UNKNOWN: a time-out
        raise FusesearchError(f"cpsat: CP-SAT found the search model {solver.status_name(status)} "
                              f"({model.validate() or 'no reason given'}) on {n} nodes; plan with "
                              "--strategy greedy meanwhile and report this")
    resolve = None
    if status == cp_model.OPTIMAL:
        model.add(objective <= _objective(solver, costs, x))
        solver, resolve = _deterministic_optimum(model, solver, deadline - SAFETY_PER_NODE_S * n)
    return _result(problem, candidates, solver, status, x, costs, unit, hint, resolve)


def _objective(solver, costs: list[int], x) -> int:
    """The chosen plan's cost in exact integer units. CP-SAT reports `objective_value` as a
    float that may fall just short of the integer (2179528.9999999995 for 2179529): truncated,
    it would bound the re-solve below the optimum and make it infeasible."""
    return sum(c for c, var in zip(costs, x, strict=True) if solver.value(var))


def _deterministic_optimum(model, first, deadline: float):
    """Parallel workers may prove the optimum with different, equally fast plans. One worker is
    deterministic: re-solve with the optimum as a constraint (so it only has to find a plan, not
    prove one) and the greedy hint already in the model, and return that plan, with the re-solve's
    status name (reported as the `resolve_status` statistic)."""
    second = cp_model.CpSolver()
    second.parameters.num_workers = 1
    second.parameters.max_deterministic_time = CANONICAL_DETERMINISTIC_TIME
    second.parameters.max_time_in_seconds = max(MIN_SOLVE_S, deadline - time.perf_counter() - SAFETY_S)
    status = second.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):  # only a time-out: the optimum is feasible
        log.warning("cpsat: the deterministic re-solve found no plan in time (%s); keeping the first "
                    "optimal plan, which may differ between runs", second.status_name(status))
        return first, second.status_name(status)
    return _Combined(first, second), second.status_name(status)


class _Combined:
    """The first solve's status, bound and statistics with the canonical solve's values."""

    def __init__(self, first, second) -> None:
        self._first, self._second = first, second

    def __getattr__(self, name):
        return getattr(self._first, name)

    def value(self, var):
        return self._second.value(var)


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
    if workers <= FEW_WORKERS:
        params.extra_subsolvers.extend(["max_lp", "core"])


def _result(problem, candidates, solver, status, x, costs, unit: int, hint, resolve: str | None) -> SolveResult:
    name = solver.status_name(status)
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    bound_s = solver.best_objective_bound * unit / PS_PER_S if found else None
    stats = {"solver_status": name, "objective_ps": None, "conflicts": solver.num_conflicts,
             "branches": solver.num_branches, "solver_wall_s": round(solver.wall_time, 3),
             "resolve_status": resolve}
    if found:
        groups = tuple(g for g, var in zip(candidates.groups, x, strict=True) if solver.value(var))
        stats["objective_ps"] = _objective(solver, costs, x) * unit
    else:
        log.warning("cpsat found no solution in time (%s); returning the greedy plan", name)
        groups, name = tuple(hint), "FEASIBLE"
        stats["fallback"] = "greedy"
    groups = tuple(sorted(groups, key=min))
    objective_s = problem.partition_time_s(groups)
    if bound_s is not None:  # ps rounding above; and every cost is >= 0, whatever LP bound came back
        bound_s = max(0.0, min(bound_s, objective_s))
    return SolveResult(groups, name, objective_s, bound_s, 0.0, stats)
