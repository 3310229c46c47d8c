"""Generated-kernel benchmarks on the CPU backend (figures printed, not asserted).

1. Chains of 5 elementwise ops over 16M float32: one fused generated kernel vs one generated kernel
   per op. Target: fused >= 2x faster. Two chains: arithmetic (Relu, Mul, Add, Neg, Abs: memory
   bound, where fusion saves DRAM round trips) and transcendental (Relu, Mul, Add, Tanh, Sigmoid:
   compute bound on a CPU, where fusion saves less).
2. Measured plan-vs-unfused speedup of zoo bert-small and resnet18 with the cpsat plan
   (every kernel run on real data; medians per kernel summed).

    .venv/bin/python benchmarks/bench_kernels.py [--repeats 5] [--budget 0.3] [--models bert-small,resnet18]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fusesearch.api import plan as make_plan
from fusesearch.backends import cpu
from fusesearch.backends.codegen import generate
from fusesearch.backends.timing import measure
from fusesearch.groups import FusionGroup
from fusesearch.lowering import lower
from fusesearch.measure import measure_plan
from fusesearch.pipeline import prepare

N = 16 * 1024 * 1024


CHAINS = {"arithmetic": ("Neg", "Abs"), "transcendental": ("Tanh", "Sigmoid")}


def chain_model(path: Path, tail: tuple[str, str]) -> str:
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"), helper.make_node("Mul", ["a", "s"], ["b"], name="mul"),
             helper.make_node("Add", ["b", "c"], ["d"], name="add"), helper.make_node(tail[0], ["d"], ["e"], name="op4"),
             helper.make_node(tail[1], ["e"], ["y"], name="op5")]
    inits = [numpy_helper.from_array(np.float32(0.5), "s"), numpy_helper.from_array(np.float32(0.1), "c")]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return str(path)


def chain(name: str, repeats: int, budget_s: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        prep = prepare(chain_model(Path(tmp) / "chain.onnx", CHAINS[name]))
    g = prep.graph
    x = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    fused = generate(g, lower(g, FusionGroup(frozenset(range(len(g))))))
    singles = [generate(g, lower(g, FusionGroup.single(i))) for i in range(len(g))]
    values = {"x": x, "s": np.float32(0.5), "c": np.float32(0.1)}
    fused_run = cpu.runner(fused, values)
    d = np.maximum(x, 0) * np.float32(0.5) + np.float32(0.1)
    expected = np.abs(-d) if name == "arithmetic" else 1 / (1 + np.exp(-np.tanh(d)))
    fused_run()
    assert np.allclose(fused_run.buffers[-1], expected, atol=1e-5)
    runs = []
    for k in singles:
        inputs = {t: values.get(t, x) for t in (a.tensor for a in k.inputs)}
        runs.append(cpu.runner(k, inputs))
    fused_s, unfused_s = [], []
    for _ in range(repeats):
        fused_s.append(measure(fused_run, budget_s=budget_s).median_s)
        unfused_s.append(sum(measure(r, budget_s=budget_s / len(runs)).median_s for r in runs))
    f, u = statistics.median(fused_s), statistics.median(unfused_s)
    print(f"{name} chain ({'+'.join(n.op_type for n in g.nodes)}) x 16M float32 (CPU, median of {repeats}): fused {f * 1e3:.1f} ms, "
          f"one kernel per op {u * 1e3:.1f} ms -> {u / f:.2f}x (target >= 2x)")


def zoo(models: list[str], budget_s: float) -> None:
    for name in models:
        prep = prepare(f"zoo:{name}")
        p = make_plan(f"zoo:{name}", device="host", strategy="cpsat", prepared=prep)
        none = make_plan(f"zoo:{name}", device="host", strategy="none", prepared=prep, lone_anchors="library")
        report = measure_plan(prep, p, none, "cpu", budget_s=budget_s)
        t = report.totals()
        print(f"{name} cpsat plan on CPU: {p.kernels} kernels measured {t['measured_s'] * 1e3:.1f} ms vs unfused "
              f"{none.kernels} kernels {t['unfused_measured_s'] * 1e3:.1f} ms -> measured speedup {t['speedup']:.2f}x "
              f"(predicted {none.time_s / p.time_s:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.3)
    parser.add_argument("--models", default="bert-small,resnet18")
    args = parser.parse_args()
    if not cpu.available():
        raise SystemExit(f"no C compiler: {cpu.available().reason}")
    for name in CHAINS:
        chain(name, args.repeats, args.budget)
    zoo([m for m in args.models.split(",") if m], args.budget)


if __name__ == "__main__":
    main()
