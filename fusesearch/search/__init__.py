"""Fusion search: the strategies behind one Solver protocol, and `search()`, the pipeline.

    Graph ─► SearchProblem(legality on a device) ─► Solver.solve ─► validate_plan ─► Plan

`SOLVERS` maps each strategy name to its class: `none` (every node alone), `rules` (the classic
OpenPPL / ONNX Runtime patterns), `greedy` (priority merging, as XLA), `cpsat` (exact, OR-Tools;
imported only when asked for, so the rest works without ortools). Only `cpsat` chooses layouts
(`SearchConfig.layouts`): the other strategies keep every tensor NCHW; a plan of a graph where
layouts could be chosen records the choice and its block (plan.json's "layouts").
"""

from __future__ import annotations

from costmodels import DeviceSpec, RooflineModel
from costmodels.profile import priced_by
from fusesearch.costing import graph_figures
from fusesearch.errors import BadInput
from fusesearch.ir.graph import Graph
from fusesearch.plans import ModelInfo, Plan, SolverInfo
from fusesearch.search.greedy import GreedySolver
from fusesearch.search.none import NoFusion
from fusesearch.search.problem import (
    SearchConfig,
    SearchProblem,
    Solver,
    SolveResult,
    layouts_record,
    plan_layout,
    singletons,
)
from fusesearch.search.rules import RulesSolver

STRATEGIES = ("none", "rules", "greedy", "cpsat")


def _cpsat() -> Solver:
    from fusesearch.search.cpsat import CpSatSolver

    return CpSatSolver()


SOLVERS = {"none": NoFusion, "rules": RulesSolver, "greedy": GreedySolver, "cpsat": _cpsat}


def get_solver(strategy: str) -> Solver:
    if strategy not in SOLVERS:
        raise BadInput(f"--strategy {strategy}: unknown; choose one of {', '.join(STRATEGIES)}")
    return SOLVERS[strategy]()


def search(graph: Graph, device: DeviceSpec, model: RooflineModel, strategy: str, *,
           config: SearchConfig | None = None, device_label: str | None = None,
           profile: str | None = None, model_info: ModelInfo | None = None,
           problem: SearchProblem | None = None) -> Plan:
    solver = get_solver(strategy)
    problem = problem or SearchProblem.build(graph, device, model, config)
    result = solver.solve(problem, time_limit_s=problem.config.time_limit_s, seed=problem.config.seed)
    figures = graph_figures(graph, device, model)
    # the unfused reference is strategy none's plan, priced as it runs: every node alone, each in
    # the form the device runs fastest (on a CPU a lone anchor as our C unless the library is faster)
    unfused_s = problem.partition_time_s(singletons(graph))
    info = SolverInfo(result.status, result.objective_s, result.bound_s, result.wall_s, dict(result.stats))
    model_info = model_info or ModelInfo(graph.name, "", len(graph), len(graph))
    layout = plan_layout(graph, device, "auto")
    return Plan.build(problem.legality, list(result.groups), strategy=strategy,
                      device=device_label or device.name, profile=profile, solver=info, model=model_info,
                      unfused_time_s=unfused_s, lower_bound_s=figures.lower_bound_s,
                      priced=priced_by(device, profile), blocked=result.blocked,
                      layouts=layouts_record(problem.config.layouts, layout) if layout.blocked else None)


__all__ = ["SOLVERS", "STRATEGIES", "SearchConfig", "SearchProblem", "SolveResult", "Solver", "get_solver",
           "search"]
