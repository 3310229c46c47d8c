"""Each kernel inside the whole program beside the same kernel timed alone (figures printed,
never asserted).

Problem: `measure` (and `bench_cpu.py` sections 3 and 4) times every kernel alone, many runs in a
row, so its weights and inputs stay in the cache between runs; in the program a user runs
(`fusesearch run`) each kernel comes after the others, its weights come from wherever the rest of
the model left them, and ONNX Runtime, timed in the same rounds, runs in between. The sum of the
kernels timed alone is then not the program's time, and which kernels the difference falls on
says what to fix (a kernel that streams its weights more than once, one that reads cold inputs).
Approach: the cpsat plan for `host` built as one program with each kernel call timed in C
(`run.Program(profile=True)`: OpenMP's clock around each call, summed over the runs), run in
rounds with ONNX Runtime's whole model (ENABLE_ALL) in between, as `fusesearch run` times them;
beside each kernel, `measure`'s time for the same kernel alone (its median, interleaved rounds;
`--baseline generated`, so a lone conv or GEMM is our kernel there too, as in the program, not
ONNX Runtime's) and the cost model's prediction; then the totals: the program's wall time and ONNX
Runtime's (median, p20-p80), the sum of its kernels inside it (a mean: the C clock sums each call
over the rounds), the sum alone and the prediction, all one thread (`--threads N`: the plan priced for and run with N,
ONNX Runtime with N; the kernels alone are timed at OMP_NUM_THREADS's count, so set it to N too).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_program.py [--models resnet18,bert-small]
        [--runs 20] [--top 12] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
from benchutil import spread

from fusesearch.api import plan as make_plan
from fusesearch.ir.canonicalize import to_proto
from fusesearch.measure import measure_plan
from fusesearch.pipeline import prepare
from fusesearch.run import Program, plan_steps
from fusesearch.verify import random_feeds, session, session_feeds


def one_model(name: str, runs: int, top: int, threads: int) -> None:
    prep = prepare(f"zoo:{name}")
    plan = make_plan(f"zoo:{name}", device="host", strategy="cpsat", prepared=prep, threads=threads)
    unfused = make_plan(f"zoo:{name}", device="host", strategy="none", prepared=prep, threads=threads)
    canonical = to_proto(prep.canonical)
    weights = {t.name: np.ascontiguousarray(onnx.numpy_helper.to_array(t)) for t in canonical.graph.initializer}
    feeds = random_feeds(canonical, 0)
    program = Program(prep.graph, canonical, plan_steps(prep.graph, plan), weights, threads, profile=True)
    program.set_inputs(feeds)
    ort = session(canonical, threads=threads, optimize=True)
    names, ort_feeds = [o.name for o in ort.get_outputs()], session_feeds(ort, feeds)
    for _ in range(3):  # warm-up: weights packed, scratch allocated
        program.run()
        ort.run(names, ort_feeds)
    program.kernel_seconds(reset=True)
    wall, theirs = [], []
    for _ in range(runs):  # one run of each per round, as `fusesearch run` times them
        t0 = time.perf_counter()
        program.run()
        wall.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ort.run(names, ort_feeds)
        theirs.append(time.perf_counter() - t0)
    inside = {g: s / runs for g, s in program.kernel_seconds().items()}
    report = measure_plan(prep, plan, unfused, "cpu", budget_s=0.2, baseline="generated")  # lone anchors as the program runs them
    alone = {m.group: m.measured_s for m in report.plan}
    predicted = {m.group: m.predicted_s for m in report.plan}
    ops = {g.id: "+".join(prep.graph.nodes[i].op_type for i in g.nodes) for g in plan.groups}
    print(f"{name}: {len(inside)} generated kernels, {runs} rounds of the program and ONNX Runtime (ENABLE_ALL) in turn")
    print(f"   {'group':>5s} {'in program':>11s} {'alone':>9s} {'predicted':>9s}  in program / alone  ops")
    for g in sorted(inside, key=inside.get, reverse=True)[:top]:
        ratio = inside[g] / alone[g] if alone.get(g) else float("nan")
        print(f"   g{g:<4d} {inside[g] * 1e3:8.3f} ms {alone.get(g, float('nan')) * 1e3:6.3f} ms "
              f"{predicted.get(g, float('nan')) * 1e3:6.3f} ms  {ratio:17.2f}x  {ops.get(g, 'reorder')[:60]}")
    total_inside = sum(inside.values())
    total_alone = sum(alone[g] for g in inside if g in alone)
    total_predicted = sum(predicted[g] for g in inside if g in predicted)
    print(f"   program {_spread(wall)} ms (median wall, p20-p80); its kernels inside it {total_inside * 1e3:.2f} ms "
          f"(their mean over the rounds), alone {total_alone * 1e3:.2f} ms (inside / alone "
          f"{total_inside / total_alone:.2f}x), predicted {total_predicted * 1e3:.2f} ms; ONNX Runtime whole model "
          f"{_spread(theirs)} ms (program / ONNX Runtime {statistics.median(wall) / statistics.median(theirs):.2f}x)")


def _spread(samples: list[float]) -> str:
    """`median (p20-p80)` in ms."""
    p20, median, p80 = np.percentile(samples, [20, 50, 80])
    return spread(median, p20, p80, digits=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet18,bert-small")
    parser.add_argument("--runs", type=int, default=20, help="timed rounds of the program and ONNX Runtime")
    parser.add_argument("--threads", type=int, default=1, help="the plan priced for and run with these "
                        "OpenMP threads, ONNX Runtime with as many")
    parser.add_argument("--top", type=int, default=12, help="kernels listed, the slowest inside the program first")
    args = parser.parse_args()
    for name in args.models.split(","):
        one_model(name.strip(), args.runs, args.top, args.threads)


if __name__ == "__main__":
    main()
