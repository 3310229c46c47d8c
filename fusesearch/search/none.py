"""Strategy `none`: every node its own kernel — the unfused reference."""

from __future__ import annotations

import time

from fusesearch.search.problem import SearchProblem, SolveResult, singletons


class NoFusion:
    name = "none"

    def solve(self, problem: SearchProblem, *, time_limit_s: float = 0.0, seed: int = 0) -> SolveResult:
        start = time.perf_counter()
        groups = singletons(problem.graph)
        return SolveResult(groups, "BASELINE", problem.partition_time_s(groups), None,
                           time.perf_counter() - start)
