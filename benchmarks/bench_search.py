"""Search benchmarks (figures printed, not asserted).

1. Zoo models on a device: per strategy, kernels, predicted time and wall time; cpsat status/gap.
   Targets (2 cores): bert-base and resnet50 — enumeration + cpsat OPTIMAL (or gap <= 1%) within
   60 s; greedy under 5 s.
2. A synthetic 10,000-node chain (`tests/search/chains.py`: residual blocks of gemm, pointwise and
   rowwise ops): greedy within 5 s; cpsat, decomposed, proves its optimum within 60 s.
Each timing is the median of --repeats runs.

    .venv/bin/python benchmarks/bench_search.py [--models resnet50,bert-base] [--device h100-sxm]
        [--repeats 3] [--synthetic 10000] [--time-limit 60] [--workers 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from costmodels import RooflineModel, load_device
from fusesearch.pipeline import prepare
from fusesearch.search import SearchConfig, SearchProblem, search
from tests.search.chains import chain_graph


def median_run(fn, repeats):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times), times


def zoo_table(models, device, repeats, time_limit):
    spec, params = load_device(device)
    model = RooflineModel(params)
    print(f"device {device}; median of {repeats} runs; cpsat time limit {time_limit:g} s")
    print(f"{'model':12} {'strategy':8} {'kernels':>7} {'predicted':>12} {'speedup':>8} {'status':>10} "
          f"{'gap':>7} {'wall (median)':>14}")
    for name in models:
        prep = prepare(f"zoo:{name}")
        for strategy in ("none", "rules", "greedy", "cpsat"):
            config = SearchConfig(time_limit_s=time_limit)
            plan, med, _ = median_run(
                lambda s=strategy, g=prep.graph, c=config: search(g, spec, model, s, config=c), repeats)
            gap = ("" if plan.solver.bound_s is None else
                   f"{max(0.0, 1 - plan.solver.bound_s / plan.solver.objective_s):.2%}")
            print(f"{name:12} {strategy:8} {plan.kernels:>7} {plan.time_s * 1e6:>9.1f} us {plan.speedup:>7.2f}x "
                  f"{plan.solver.status:>10} {gap:>7} {med:>12.2f} s")


def synthetic(n, device, time_limit, workers):
    spec, params = load_device(device)
    graph = chain_graph(n)
    config = SearchConfig(time_limit_s=time_limit, workers=workers)
    model = RooflineModel(params)
    start = time.perf_counter()
    greedy = search(graph, spec, model, "greedy", problem=SearchProblem.build(graph, spec, model, config))
    greedy_s = time.perf_counter() - start
    print(f"synthetic chain, {n} nodes: greedy {greedy_s:.1f} s (target <= 5 s), {greedy.kernels} kernels; "
          f"load average {os.getloadavg()[0]:.1f}")
    start = time.perf_counter()
    plan = search(graph, spec, model, "cpsat", problem=SearchProblem.build(graph, spec, model, config))
    d = plan.solver.stats.get("decomposition", {})
    print(f"synthetic chain, {n} nodes: cpsat {plan.solver.status} in {time.perf_counter() - start:.1f} s "
          f"(target proven optimal <= 60 s; {workers} worker(s)), {d.get('pieces')} pieces, {d.get('distinct')} "
          f"distinct subproblems, {plan.solver.stats['candidates']} candidates; {plan.kernels} kernels, predicted "
          f"{plan.time_s * 1e3:.3f} ms vs greedy {greedy.time_s * 1e3:.3f} ms; load average {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,bert-base")
    parser.add_argument("--device", default="h100-sxm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--synthetic", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=1, help="CP-SAT workers (the synthetic chain's)")
    args = parser.parse_args()
    if args.models:
        zoo_table([m for m in args.models.split(",") if m], args.device, args.repeats, args.time_limit)
    if args.synthetic:
        synthetic(args.synthetic, args.device, args.time_limit, args.workers)


if __name__ == "__main__":
    main()
