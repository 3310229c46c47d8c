"""The exact solver keeps the quotient acyclic lazily: a plan with a cycle is cut off and solved
again, and after CUT_ROUNDS cuts the ranks exclude every cycle; either way the same optimum."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from costmodels import RooflineModel, get_device
from fusesearch.plans import validate_plan
from fusesearch.search import SearchConfig, SearchProblem
from fusesearch.search import cpsat as cpsat_module
from fusesearch.search.cpsat import CpSatSolver
from tests.search.test_search import CYCLE, build, random_dags

H100 = get_device("h100-sxm")
MODEL = RooflineModel()


def solve(graph, max_group_size: int = 16):
    problem = SearchProblem.build(graph, H100, MODEL, SearchConfig(time_limit_s=20, workers=1,
                                                                   max_group_size=max_group_size))
    return CpSatSolver(decompose=False).solve(problem, time_limit_s=20, seed=0)


def test_a_plan_with_a_quotient_cycle_is_cut_and_solved_again(monkeypatch):
    """With groups of two, both ways of pairing p, q, r, s across form a cycle: set partitioning
    alone picks one, the cuts refuse both, and the plan found is the one the ranks give."""
    graph = build(CYCLE)
    lazy = solve(graph, max_group_size=2)
    assert lazy.stats["cycle_cuts"] >= 2 and not lazy.stats["ranks"]
    assert lazy.status == "OPTIMAL" and validate_plan(graph, lazy.groups)
    assert max(len(g) for g in lazy.groups) == 2  # one pair fused, not every node alone
    for rounds in (0, 1):
        monkeypatch.setattr(cpsat_module, "CUT_ROUNDS", rounds)
        ranked = solve(graph, max_group_size=2)
        assert ranked.stats["ranks"] and ranked.stats["cycle_cuts"] == rounds
        assert ranked.status == "OPTIMAL" and validate_plan(graph, ranked.groups)
        assert ranked.stats["objective_ps"] == lazy.stats["objective_ps"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dags())
def test_random_dags_cuts_equal_ranks(graph):
    lazy = solve(graph, max_group_size=4)
    original = cpsat_module.CUT_ROUNDS
    try:
        cpsat_module.CUT_ROUNDS = 0
        ranked = solve(graph, max_group_size=4)
    finally:
        cpsat_module.CUT_ROUNDS = original
    assert lazy.status == ranked.status == "OPTIMAL"
    assert lazy.stats["objective_ps"] == ranked.stats["objective_ps"]
    assert validate_plan(graph, lazy.groups)
