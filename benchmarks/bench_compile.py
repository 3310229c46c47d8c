"""A plan's compile time from a cold cache: every generated C kernel of a zoo model's plan compiled
and linked into one program, as `fusesearch run` does (figures printed, never asserted).

Problem: `run`, `measure` and the search's measured costs compile every kernel of a plan the first
time it is seen on a machine; that time is what a user waits for before anything runs.
Approach: the plan for `host` (cpsat, or `--strategy`) is made once, its kernels generated, then
`run.build_library` is timed `--rounds` times, each round in a fresh, empty cache folder
(`FUSESEARCH_CACHE` set per round, so the shared C runtime is built again too), reporting each
round's seconds (wall, and the compilers' CPU time, which the machine's other load changes less)
and the medians. Run under `taskset -c 0` for one compiler at a time.

    FUSESEARCH_CACHE=/tmp/x taskset -c 0 .venv/bin/python benchmarks/bench_compile.py --model bert-base
        [--strategy cpsat] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time

import numpy as np
import onnx

from fusesearch.api import plan as make_plan
from fusesearch.ir.canonicalize import to_proto
from fusesearch.pipeline import prepare
from fusesearch.run import Program, build_library, plan_steps, segments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bert-base")
    parser.add_argument("--strategy", default="cpsat")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    prep = prepare(f"zoo:{args.model}")
    plan = make_plan(f"zoo:{args.model}", device="host", strategy=args.strategy, prepared=prep)
    canonical = to_proto(prep.canonical)
    weights = {t.name: np.ascontiguousarray(onnx.numpy_helper.to_array(t)) for t in canonical.graph.initializer}
    steps = plan_steps(prep.graph, plan)
    runs = [run for kind, run in segments(steps) if kind == "generated"]
    kernels = [s.kernel for run in runs for s in run if s.kernel is not None]
    driver = Program.driver(_Layout(prep.graph, canonical, steps, weights), runs)
    seconds, cpu_seconds = [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            os.environ["FUSESEARCH_CACHE"] = cache
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            build_library(kernels, driver)
            seconds.append(time.perf_counter() - t0)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu_seconds.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        print(f"  {args.model}: {len(kernels)} kernels ({len({k.c_source for k in kernels})} distinct sources) "
              f"compiled and linked in {seconds[-1]:.2f} s ({cpu_seconds[-1]:.2f} s of compiler CPU)", flush=True)
    print(f"{args.model} ({args.strategy}, host): median {statistics.median(seconds):.2f} s "
          f"({statistics.median(cpu_seconds):.2f} s of compiler CPU) over {args.rounds} cold rounds")


class _Layout(Program):
    """A Program's layout and driver text without compiling it (the timed part)."""

    def __init__(self, graph, canonical, steps, weights) -> None:
        super(Program, self).__init__(graph, steps, weights, reuse=True)
        self.profile = False
        self.ext_index = dict(self.ext_index)
        packed = [(s.kernel.name, p.arg.name) for s in self.steps if s.kernel is not None for p in s.kernel.packed]
        self.pk_index = {key: len(self.ext_index) + i for i, key in enumerate(packed)}


if __name__ == "__main__":
    main()
