"""Search benchmarks (figures printed, not asserted).

1. Zoo models on a device: per strategy, kernels, predicted time and wall time; cpsat status/gap.
   Targets (2 cores): bert-base and resnet50 — enumeration + cpsat OPTIMAL (or gap <= 1%) within
   60 s; greedy under 5 s.
2. A synthetic 10,000-node graph (a deep residual network of pointwise/gemm/rowwise ops):
   enumeration + greedy under 30 s; cpsat returns a valid plan within its time limit.
Each timing is the median of --repeats runs.

    .venv/bin/python benchmarks/bench_search.py [--models resnet50,bert-base] [--device h100-sxm]
        [--repeats 3] [--synthetic 10000] [--time-limit 60]
"""

from __future__ import annotations

import argparse
import statistics
import time

from costmodels import RooflineModel, load_device
from fusesearch.candidates.enumerate import enumerate_candidates
from fusesearch.ir.graph import Graph, Node, TensorInfo
from fusesearch.ir.op_kind import kind_of
from fusesearch.pipeline import prepare
from fusesearch.search import SearchConfig, SearchProblem, search


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


def synthetic_graph(n: int) -> Graph:
    """Blocks of [MatMul → Add bias → Relu → Softmax → Add residual], all [64, 256] float32."""
    nodes, tensors = [], {"x": TensorInfo("x", (64, 256), "float32"),
                          "w": TensorInfo("w", (256, 256), "float32", True),
                          "b": TensorInfo("b", (256,), "float32", True)}
    prev, residual = "x", "x"
    pattern = [("MatMul", lambda p, r: (p, "w")), ("Add", lambda p, r: (p, "b")), ("Relu", lambda p, r: (p,)),
               ("Softmax", lambda p, r: (p,)), ("Add", lambda p, r: (p, r))]
    for i in range(n):
        op, ins = pattern[i % len(pattern)]
        out = f"t{i}"
        attrs = {"axis": -1} if op == "Softmax" else {}
        nodes.append(Node(i, f"n{i}", op, "", kind_of(op), ins(prev, residual), (out,), attrs))
        tensors[out] = TensorInfo(out, (64, 256), "float32")
        prev = out
        if i % len(pattern) == len(pattern) - 1:
            residual = out
    return Graph.build("synthetic", nodes, tensors, ["x"], [prev])


def synthetic(n, device, time_limit):
    spec, params = load_device(device)
    graph = synthetic_graph(n)
    problem = SearchProblem.build(graph, spec, RooflineModel(params), SearchConfig(time_limit_s=time_limit))
    start = time.perf_counter()
    candidates = enumerate_candidates(problem.legality, budget_per_seed=problem.config.budget_per_seed)
    enum_s = time.perf_counter() - start
    greedy = search(graph, spec, problem.legality.model, "greedy", problem=problem)
    greedy_s = time.perf_counter() - start
    print(f"synthetic {n} nodes: enumeration {enum_s:.1f} s ({len(candidates)} candidates, "
          f"{candidates.checked} checks); enumeration + greedy {greedy_s:.1f} s (target < 30 s), "
          f"{greedy.kernels} kernels")
    start = time.perf_counter()
    plan = search(graph, spec, problem.legality.model, "cpsat", problem=problem)
    print(f"synthetic {n} nodes: cpsat {plan.solver.status} in {time.perf_counter() - start:.1f} s "
          f"(limit {time_limit:g} s), {plan.kernels} kernels, predicted {plan.time_s * 1e3:.3f} ms vs greedy "
          f"{greedy.time_s * 1e3:.3f} ms; plan valid")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,bert-base")
    parser.add_argument("--device", default="h100-sxm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--synthetic", type=int, default=10_000)
    args = parser.parse_args()
    if args.models:
        zoo_table([m for m in args.models.split(",") if m], args.device, args.repeats, args.time_limit)
    if args.synthetic:
        synthetic(args.synthetic, args.device, args.time_limit)


if __name__ == "__main__":
    main()
