"""Strategy `cpsat`: exact set partitioning over the candidates with OR-Tools CP-SAT.

Problem: the partition into candidate groups (and their layouts) of least predicted time, acyclic.
Approach: x_g ∈ {0,1} per candidate, costs in integer ps (coarser past MAX_OBJECTIVE); Σ_{g ∋ v}
x_g = 1. Acyclicity lazily: a plan with a quotient cycle C gets Σ_{g ∈ C} x_g ≤ |C| − 1, solved
again; after CUT_ROUNDS cuts, ranks r_v (equal inside a group, increasing between groups) exclude
every cycle. Hinted with greedy's plan; with several workers one worker tries first
(`ONE_WORKER_FIRST`), past it a one-worker re-solve at Σ c_g x_g ≤ optimum makes the plan
deterministic. Layouts (`_add_layouts`): a bool b_g ≤ x_g per blocked-capable candidate (= x_g
with a blocked form alone, `Legality.blocked_only`), two per 4-D tensor for its reorders; the LP
fully linearized. Graphs from DECOMPOSE_FROM_NODES nodes are cut by `decompose.split`, each
distinct piece solved once by one worker in NCHW (no blocked-only groups), joined by `join`.
Invariants: never worse than rules or greedy (their groups are candidates); a time-out returns the
best plan with its gap (`stopped`), nothing better greedy's (`fallback`); a bad model is an
internal error; the only module importing ortools."""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ortools.sat.python import cp_model

from fusesearch.candidates.enumerate import (
    CandidateSet,
    blocked_only_candidates,
    enumerate_candidates,
)
from fusesearch.errors import FusesearchError
from fusesearch.layout import NCHW, Layout
from fusesearch.lowering import kernel_layouts
from fusesearch.plans import InvalidPlan, order_groups
from fusesearch.search import decompose
from fusesearch.search.greedy import greedy_partition
from fusesearch.search.problem import SearchProblem, SolveResult
from fusesearch.search.rules import rules_partition

log = logging.getLogger(__name__)

PS_PER_S = 1e12
MAX_OBJECTIVE = 1 << 53  # Σ of all candidates' costs in solver units: int64-safe, exact in CP-SAT's doubles
CANONICAL_DETERMINISTIC_TIME = 60.0  # CP-SAT's deterministic time units (~seconds), one worker
# with several workers, one worker first for this long (deterministic units): where it proves the
# optimum that plan is kept, the one `--workers 1` gives; the many-worker solve and its one-worker
# re-solve at the optimum only past it (yolo-neck: the re-solve alone took 24-55 s, one worker 0.9 s)
ONE_WORKER_FIRST = 5.0
MIN_SOLVE_S = 1.0  # CP-SAT always gets this long, even past the deadline (the hint is a plan)
SAFETY_S = 0.5  # reading the solution back ...
SAFETY_PER_NODE_S = 2e-4  # ... and building the validated plan (costs, unfused figures) after it
FEW_WORKERS = 4
# below this many nodes one model proves the optimum faster than the decomposition's many small ones
# (experiments/scaling, 1 worker: LLaMA decode 497 nodes 3.6 s whole, 9.1 s decomposed; about even
# near 1,000; from 1,600 on decomposed is faster: LLaMA prefill 4,809 nodes 11 s against 43 s)
DECOMPOSE_FROM_NODES = 1000
CUT_ROUNDS = 20  # plans refused for a quotient cycle before the ranks are added


class CpSatSolver:
    name = "cpsat"

    def __init__(self, decompose: bool | None = None) -> None:
        self.decompose = decompose  # None: as `SearchConfig.decompose` says
        self.solves = 0  # CP-SAT models solved (subproblems with equal keys count once)
        self._lock = threading.Lock()

    def solve(self, problem: SearchProblem, *, time_limit_s: float, seed: int) -> SolveResult:
        start = time.perf_counter()
        greedy = greedy_partition(problem)
        rules = rules_partition(problem)
        candidates = enumerate_candidates(problem.legality, budget_per_seed=problem.config.budget_per_seed,
                                          extra=[*greedy, *rules])
        whole = not self._decomposes(problem)
        if whole:  # the groups with a blocked form alone, where the one model chooses layouts
            candidates = CandidateSet((*candidates.groups, *blocked_only_candidates(problem.legality)),
                                      candidates.checked)
        enumerated_s = time.perf_counter() - start
        costs, unit = _costs(problem, candidates.groups)
        deadline = start + time_limit_s
        chain = None if whole else decompose.split(len(problem.graph), candidates.groups)
        result = None
        if chain is not None and chain.pieces > 1:
            result = self._solve_chain(problem, candidates.groups, chain, costs, unit, greedy, deadline, seed)
        if result is None:
            part = self._solve_part(problem, candidates.groups, range(len(problem.graph)),
                                    range(len(candidates)), (costs, unit), greedy, deadline, seed)
            result = _result(problem, candidates.groups, part, unit, greedy)
        stats = {**result.stats, "candidates": len(candidates), "enumeration_checks": candidates.checked,
                 "enumeration_s": round(enumerated_s, 3)}
        return SolveResult(result.groups, result.status, result.objective_s, result.bound_s,
                           time.perf_counter() - start, stats, result.blocked)

    def _decomposes(self, problem: SearchProblem) -> bool:
        if self.decompose is not None:
            return self.decompose
        how = problem.config.decompose
        return how == "always" or (how == "auto" and len(problem.graph) >= DECOMPOSE_FROM_NODES)

    def _solve_part(self, problem, groups, nodes, indices, costs, hint, deadline, seed, piece=False) -> _Part:
        """A piece by one CP-SAT worker, its tensors in NCHW; the whole graph by `config.workers`,
        choosing layouts where the problem may (`Legality.layout`). `costs`: (the
        candidates' integer costs, their unit in picoseconds)."""
        with self._lock:
            self.solves += 1
        return _solve_model(problem, groups, nodes, indices, costs, hint, deadline, seed,
                            1 if piece else problem.config.workers, layouts=not piece)

    def _solve_chain(self, problem, groups, chain, costs, unit, greedy, deadline, seed) -> SolveResult | None:
        """The exact plan joined from the chain's subproblems (`decompose`), each distinct one solved
        once; None when the joined plan has a cycle across pieces (the whole graph is solved then)."""
        subs = decompose.subproblems(problem.graph, chain, groups, costs)
        first: dict[tuple, decompose.Subproblem] = {}
        for sub in subs:
            first.setdefault(sub.key, sub)
        parts = self._solve_distinct(problem, groups, chain, list(first.values()), costs, greedy, deadline, seed)
        solutions: dict[tuple, decompose.Solution] = {}
        statuses: dict[str, int] = {}
        solver_s = 0.0
        for sub, (part, chosen) in zip(first.values(), parts, strict=True):
            statuses[part.status] = statuses.get(part.status, 0) + 1
            solver_s += part.stats["solver_wall_s"]
            local = tuple(tuple(sorted(v - sub.start for v in groups[i])) for i in chosen)
            value = sum(costs[i] for i in chosen)
            solutions[sub.key] = decompose.Solution(local, value, min(part.bound, value), part.status == "OPTIMAL")
        plan, value, bound, proven = decompose.join(chain, groups, costs, subs, lambda s: solutions[s.key])
        try:
            order_groups(problem.graph, plan)
        except InvalidPlan:
            log.warning("cpsat: the plan joined from %d pieces has a cycle across them; solving the whole "
                        "graph instead", chain.pieces)
            return None
        status = "OPTIMAL" if proven else "FEASIBLE"
        stats = {"solver_status": status, "objective_ps": value * unit, "solver_wall_s": round(solver_s, 3),
                 "decomposition": {"pieces": chain.pieces, "subproblems": len(subs), "distinct": len(first),
                                   "statuses": dict(sorted(statuses.items())), "proven_whole": proven}}
        if not proven:
            stats["stopped"] = "time limit"
        plan = tuple(sorted(plan, key=min))
        objective_s = problem.partition_time_s(plan)
        return _no_worse_than_greedy(problem, plan, status, objective_s, bound * unit / PS_PER_S, stats, greedy)

    def _solve_distinct(self, problem, groups, chain, distinct, costs, greedy, deadline, seed) -> list[tuple]:
        """Each distinct subproblem's answer and chosen candidates (the hint's where it found none),
        in order. `config.workers` of them at a time, each by one CP-SAT worker: one worker is
        deterministic, so the plan is the same whatever the number of workers. Each gets an equal
        share of the time left for the rounds of solves still to start."""
        workers = max(1, min(problem.config.workers, len(distinct)))
        started = [0]

        def solve(sub):
            with self._lock:
                rounds = math.ceil((len(distinct) - started[0]) / workers)
                started[0] += 1
            share = max(0.0, deadline - time.perf_counter()) / max(1, rounds)
            nodes, candidates = sub.nodes, sub.candidates(chain, groups)
            inside = set(nodes)
            hint = [g for g in greedy if g <= inside]
            part = self._solve_part(problem, groups, nodes, candidates, (costs, 1), hint, time.perf_counter() + share,
                                    seed, piece=True)
            return part, part.chosen or _hinted(groups, candidates, nodes, hint)  # none found in time

        if workers == 1:
            return [solve(sub) for sub in distinct]
        with ThreadPoolExecutor(workers) as pool:  # CP-SAT releases the GIL while it solves
            return list(pool.map(solve, distinct))


def _hinted(groups, candidates, nodes, hint) -> tuple[int, ...]:
    """The hint's groups of a subproblem, its other nodes alone (every node is a candidate)."""
    index = {groups[i]: i for i in candidates}
    covered = {v for g in hint for v in g}
    return tuple(index[g] for g in (*hint, *(frozenset({v}) for v in nodes if v not in covered)))


@dataclass(frozen=True)
class _Part:
    """One CP-SAT model's answer: chosen candidate indices, its cost and bound in solver units."""

    chosen: tuple[int, ...]
    status: str  # OPTIMAL | FEASIBLE | UNKNOWN (stopped before any plan)
    value: int
    bound: int
    stats: dict
    blocked: tuple[int, ...] = ()  # of `chosen`, those in the blocked layout


def _costs(problem: SearchProblem, groups: tuple[frozenset[int], ...]) -> tuple[list[int], int]:
    """Integer costs in units of `unit` picoseconds: 1 ps, or as coarse as keeps their sum within
    MAX_OBJECTIVE (a model at huge dims costs up to 1e18 ps per candidate)."""
    ps = [problem.candidate_time_s(g) * PS_PER_S for g in groups]
    unit = max(1, math.ceil(sum(ps) / MAX_OBJECTIVE))
    return [round(t / unit) for t in ps], unit


def _solve_model(problem: SearchProblem, groups: tuple[frozenset[int], ...], nodes, indices,
                 costs: tuple[list[int], int], hint: list[frozenset[int]], deadline: float, seed: int, workers: int,
                 layouts: bool = False) -> _Part:
    """The model of the module docstring over `nodes` (a topologically ordered subset) and the
    candidates `groups[i]` for i in `indices` (all inside `nodes`), its acyclicity imposed lazily:
    a plan whose quotient has a cycle gets the cut "not all of the cycle's groups" (any plan with
    them all has that cycle) and is solved again; from CUT_ROUNDS cuts on, the ranks exclude every
    cycle at once. Set partitioning alone proves the optimum tens of times faster than with ranks.
    `layouts`: with the layout variables of `_add_layouts` where the problem has a block."""
    graph = problem.graph
    costs, unit = costs
    nodes, indices = list(nodes), list(indices)
    local = {v: j for j, v in enumerate(nodes)}
    n = len(nodes)
    model = cp_model.CpModel()
    x = [model.new_bool_var(f"x{i}") for i in indices]
    containing: list[list[int]] = [[] for _ in nodes]
    for k, i in enumerate(indices):
        for v in groups[i]:
            containing[local[v]].append(k)
    for j in range(n):
        model.add_exactly_one(x[k] for k in containing[j])
    part_costs = [costs[i] for i in indices]
    blocked, layout_terms = (_add_layouts(model, problem, groups, indices, x, containing, local, costs, unit)
                             if layouts and problem.legality.layout.blocked else ({}, []))
    terms = [*zip(part_costs, x, strict=True), *layout_terms]
    objective = sum(c * v for c, v in terms)
    model.minimize(objective)
    chosen_hint = set(hint)
    for i, var in zip(indices, x, strict=True):
        model.add_hint(var, groups[i] in chosen_hint)
    for _, var in layout_terms:  # the hint's plan keeps every tensor in NCHW
        model.add_hint(var, False)
    stats = {"conflicts": 0, "branches": 0, "solver_wall_s": 0.0, "cycle_cuts": 0, "ranks": False}
    for cuts in range(CUT_ROUNDS + 1):
        if cuts == CUT_ROUNDS:
            _add_ranks(model, graph, groups, indices, x, containing, local, hint)
            stats["ranks"] = True
        solver, status, resolve = _solve_once(model, workers, seed, objective, terms,
                                              deadline - SAFETY_PER_NODE_S * n, bool(blocked))
        stats.update(solver_status=solver.status_name(status), resolve_status=resolve)
        stats["conflicts"] += solver.num_conflicts
        stats["branches"] += solver.num_branches
        stats["solver_wall_s"] = round(stats["solver_wall_s"] + solver.wall_time, 3)
        found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
        positions = [k for k, var in enumerate(x) if solver.value(var)] if found else []
        cycle = _cycle(graph, [groups[indices[k]] for k in positions], local) if found else None
        if cycle is not None:
            stats["cycle_cuts"] += 1
            model.add(sum(x[positions[c]] for c in cycle) <= len(cycle) - 1)
        # every cost is >= 0, whatever LP bound came back; a stop before any plan keeps the bound it had
        bound = max(0, math.ceil(solver.best_objective_bound - 1e-6)) if math.isfinite(solver.best_objective_bound) else 0
        if cycle is None or time.perf_counter() >= deadline:
            break
    if cycle is not None:  # out of time with a plan that has a cycle: no plan, its bound still holds
        stats["solver_status"] = "UNKNOWN"
        return _Part((), "UNKNOWN", 0, bound, stats)
    chosen = tuple(indices[k] for k in positions)
    value = _objective(solver, terms) if found else 0
    in_blocks = tuple(indices[k] for k, var in sorted(blocked.items()) if found and solver.value(var))
    if blocked:
        stats["layouts"] = {"blocked_candidates": len(blocked), "layout_variables": len(layout_terms)}
    return _Part(chosen, solver.status_name(status), value, min(bound, value) if found else bound, stats, in_blocks)


def _solve_once(model, workers: int, seed: int, objective, terms: list[tuple[int, object]], deadline: float,
                full_lp: bool = False):
    """One CP-SAT solve of `model` by `workers` workers, made deterministic where several proved the
    optimum (`_deterministic_optimum`): (the solver to read values from, its status, the re-solve's).
    `full_lp`: every constraint in the LP relaxation (a model with layout variables: its bound at
    the default linearization leaves mobilenetv2 4% short after 5 s, fully linearized it proves the
    optimum at the root)."""
    if workers > 1 and ONE_WORKER_FIRST > 0:
        solver = _solver(1, seed, deadline, full_lp)
        solver.parameters.max_deterministic_time = ONE_WORKER_FIRST
        status = solver.solve(model)
        if status == cp_model.OPTIMAL:
            return solver, status, "one worker proved it first"
    solver = _solver(workers, seed, deadline, full_lp)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.UNKNOWN):  # UNKNOWN: a time-out
        raise FusesearchError(f"cpsat: CP-SAT found the search model {solver.status_name(status)} "
                              f"({model.validate() or 'no reason given'}) on {len(terms)} variables; plan with "
                              "--strategy greedy meanwhile and report this")
    if status != cp_model.OPTIMAL or workers == 1:  # one worker is deterministic already
        return solver, status, None
    fixed = model.clone()
    fixed.add(objective <= _objective(solver, terms))
    solver, resolve = _deterministic_optimum(fixed, solver, deadline, full_lp)
    return solver, status, resolve


def _solver(workers: int, seed: int, deadline: float, full_lp: bool):
    solver = cp_model.CpSolver()
    _configure(solver.parameters, workers, max(MIN_SOLVE_S, deadline - time.perf_counter() - SAFETY_S), seed)
    if full_lp:
        solver.parameters.linearization_level = 2
    return solver


def _cycle(graph, chosen: list[frozenset[int]], local: dict[int, int]) -> list[int] | None:
    """Positions in `chosen` of groups forming a cycle of the quotient graph (edges to nodes outside
    `local` left out), or None when it is acyclic."""
    owner = {v: gi for gi, g in enumerate(chosen) for v in g}
    succ = [sorted({owner[w] for v in g for w in graph.successors(v) if w in local} - {gi})
            for gi, g in enumerate(chosen)]
    state = [0] * len(chosen)  # 0 unvisited, 1 on the current path, 2 done
    for root in range(len(chosen)):
        if state[root]:
            continue
        path, nexts = [root], [iter(succ[root])]
        state[root] = 1
        while path:
            step = next(nexts[-1], None)
            if step is None:
                state[path.pop()] = 2
                nexts.pop()
            elif state[step] == 1:
                return path[path.index(step):]
            elif state[step] == 0:
                state[step] = 1
                path.append(step)
                nexts.append(iter(succ[step]))
    return None


def _objective(solver, terms: list[tuple[int, object]]) -> int:
    """The chosen plan's cost in exact integer units (`terms`: the objective's (cost, boolean)
    pairs). CP-SAT reports `objective_value` as a float that may fall just short of the integer
    (2179528.9999999995 for 2179529): truncated, it would bound the re-solve below the optimum and
    make it infeasible."""
    return sum(c for c, var in terms if solver.value(var))


def _deterministic_optimum(model, first, deadline: float, full_lp: bool = False):
    """Parallel workers may prove the optimum with different, equally fast plans. One worker is
    deterministic: re-solve with the optimum as a constraint (so it only has to find a plan, not
    prove one) and the greedy hint already in the model, and return that plan, with the re-solve's
    status name (reported as the `resolve_status` statistic)."""
    second = cp_model.CpSolver()
    second.parameters.num_workers = 1
    second.parameters.max_deterministic_time = CANONICAL_DETERMINISTIC_TIME
    second.parameters.max_time_in_seconds = max(MIN_SOLVE_S, deadline - time.perf_counter() - SAFETY_S)
    if full_lp:
        second.parameters.linearization_level = 2
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


def _pairs(groups, indices: list[int], containing: list[int]) -> dict[int, list[int]]:
    """For node u (the candidates `containing` it, positions in `indices`): other node v → the
    positions of the candidates containing both u and v."""
    out: dict[int, list[int]] = {}
    for k in containing:
        for v in groups[indices[k]]:
            out.setdefault(v, []).append(k)
    return out


def _add_ranks(model, graph, groups, indices: list[int], x, containing: list[list[int]], local: dict[int, int],
               hint: list[frozenset[int]]) -> None:
    """Ranks r_v (module docstring): equal inside a group and increasing along every edge between
    groups, so no plan with a quotient cycle is feasible; hinted by the hint's quotient order."""
    n = len(local)
    rank = [model.new_int_var(0, max(n - 1, 0), f"r{v}") for v in local]
    for u, j in local.items():
        shared_with = _pairs(groups, indices, containing[j])
        for v in graph.successors(u):
            if v not in local:
                continue
            together = sum(x[k] for k in shared_with.get(v, ()))
            model.add(rank[local[v]] - rank[j] + together >= 1)
            if shared_with.get(v):
                model.add(rank[local[v]] - rank[j] + n * together <= n)
    for r, gi in enumerate(order_groups(graph, hint, part=n < len(graph))):
        for v in hint[gi]:
            model.add_hint(rank[local[v]], r)


def _add_layouts(model, problem: SearchProblem, groups, indices: list[int], x, containing: list[list[int]],
                 local: dict[int, int], costs: list[int], unit: int) -> tuple[dict[int, object], list[tuple[int, object]]]:
    """The layout variables (module docstring): b_k <= x_k per candidate with a blocked form
    (`Legality.blocked`), priced at its blocked form's cost less its NCHW one (b_k = x_k, at no
    difference, for a group with a blocked form alone: x_k's cost is that form's); per 4-D tensor a
    blocked form reads or writes blocked, a boolean per reorder it may need (`lowering.reorders`:
    to blocked, to NCHW), priced as `Legality.reorder`. W_t (its producer's group writes it
    blocked) and R_ct (consumer c's group reads it blocked) are sums of b over the candidates
    holding one end of the edge and not the other (one of them is chosen unless a group holding
    both keeps t inside): up_t >= R_ct - W_t, down_t >= W_t - R_ct; down_t >= W_t (every writer)
    for a graph output.
    Returns (position -> b, the (cost, variable) terms of the objective)."""
    graph, legality = problem.graph, problem.legality
    block = legality.layout
    b: dict[int, object] = {}
    terms: list[tuple[int, object]] = []
    reads: dict[str, set[int]] = {}  # tensor -> positions of the candidates reading it blocked
    writes: dict[str, set[int]] = {}  # ... writing it blocked
    for k, i in enumerate(indices):
        verdict = legality.blocked(groups[i])
        if verdict is None:
            continue
        b[k] = model.new_bool_var(f"b{i}")
        model.add_implication(b[k], x[k])
        if legality.blocked_only(groups[i]):  # chosen, it runs blocked (its cost is the blocked form's)
            model.add_implication(x[k], b[k])
        terms.append((round(verdict.time_s * PS_PER_S / unit) - costs[i], b[k]))
        kernel = verdict.kernel
        for side, tensors in ((reads, kernel.inputs), (writes, kernel.outputs)):
            for t, lt in kernel_layouts(graph, kernel, tensors).items():
                if lt.blocked:
                    side.setdefault(t, set()).add(k)

    def price(t: str, source: Layout, target: Layout) -> int:
        return round(legality.reorder(t, source, target)[1].time_s * PS_PER_S / unit)

    for t in sorted(set(reads) | set(writes)):
        producer = graph.producer(t)
        up = model.new_bool_var(f"up:{t}") if t in reads else None
        down = model.new_bool_var(f"down:{t}") if t in writes else None
        terms += [(price(t, NCHW, block), up)] if up is not None else []
        terms += [(price(t, block, NCHW), down)] if down is not None else []
        for c in dict.fromkeys(graph.consumers(t)):
            if c not in local:
                continue
            # the sums over the candidates holding one end of the edge only: a group holding both
            # keeps t inside; so restricted, the LP relaxation cannot cover the edge with half a
            # group holding both and half a blocked producer
            written = [b[k] for k in sorted(writes.get(t, ())) if c not in groups[indices[k]]]
            read = [b[k] for k in containing[local[c]] if k in reads.get(t, ()) and producer not in groups[indices[k]]]
            if up is not None and read:
                model.add(up >= sum(read) - sum(written))
            if down is not None and written:
                model.add(down >= sum(written) - sum(read))
        if down is not None and graph.is_output(t):
            model.add(down >= sum(b[k] for k in sorted(writes[t])))
    return b, terms


def _configure(params, workers: int, time_limit_s: float, seed: int) -> None:
    params.max_time_in_seconds = float(time_limit_s)
    params.num_workers = int(workers)
    params.random_seed = int(seed)
    if workers <= FEW_WORKERS:
        params.extra_subsolvers.extend(["max_lp", "core"])


def _result(problem, groups, part: _Part, unit: int, greedy) -> SolveResult:
    """The whole graph's answer from one model's (its groups in the blocked layout among them)."""
    found = part.status in ("OPTIMAL", "FEASIBLE")
    stats = {**part.stats, "objective_ps": part.value * unit if found else None}
    if not found:
        log.warning("cpsat found no solution in time (%s); returning the greedy plan", part.status)
        stats["stopped"] = "time limit"
        return _fallback(problem, greedy, part.bound * unit / PS_PER_S, stats, "no plan found in time")
    if part.status != "OPTIMAL":
        stats["stopped"] = "time limit"
    plan = tuple(sorted((groups[i] for i in part.chosen), key=min))
    blocked = frozenset(groups[i] for i in part.blocked)
    return _no_worse_than_greedy(problem, plan, part.status, problem.plan_time_s(plan, blocked),
                                 part.bound * unit / PS_PER_S, stats, greedy, blocked)


def _no_worse_than_greedy(problem, plan, status: str, objective_s: float, bound_s: float, stats: dict,
                          greedy, blocked: frozenset[frozenset[int]] = frozenset()) -> SolveResult:
    """The plan, or greedy's where a stopped solve found nothing faster (the `fallback` statistic
    says so: CP-SAT starts from greedy's plan, so a stop that improved nothing returns it)."""
    greedy_s = problem.partition_time_s(greedy)
    if status != "OPTIMAL" and objective_s >= greedy_s:
        why = "no faster plan found in time" if objective_s == greedy_s else "the plan found was slower"
        return _fallback(problem, greedy, bound_s, stats, why)
    # ps rounding above; and every cost is >= 0, whatever bound came back
    return SolveResult(plan, status, objective_s, max(0.0, min(bound_s, objective_s)), 0.0, stats, blocked)


def _fallback(problem, greedy, bound_s: float, stats: dict, why: str) -> SolveResult:
    plan = tuple(sorted(greedy, key=min))
    objective_s = problem.partition_time_s(plan)
    return SolveResult(plan, "FEASIBLE", objective_s, max(0.0, min(bound_s, objective_s)), 0.0,
                       {**stats, "fallback": "greedy", "fallback_reason": why})
