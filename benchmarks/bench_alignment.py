"""Where a kernel's buffers fall modulo 4 KiB, and what it does to a measured speedup (figures
printed, never asserted).

Problem: a core matches a load against the stores in flight by the low 12 bits of the address
first; an output that starts a little past an input modulo 4 KiB has the store of element j taken
for the load of element j + 16 (one vector ahead) until the full addresses are compared, and the
load waits. numpy's allocator puts a buffer of under 128 KiB (bert-small's 128 x 128 tensors) at
whatever offset its heap has free, so two timings of one kernel differed by where their buffers
fell, and so did the unfused graph's 120 kernels, each timed on buffers of its own.
Approach: 1. bert-small's GELU (x (1 + erf(x / sqrt 2)), 128 x 512) as generated, its output placed
at offsets 0-2048 bytes past its input modulo 4 KiB in one page-aligned block, timed interleaved.
2. bert-small's cpsat plan against its unfused graph (`measure_plan`, as section 4 of
`bench_cpu.py`), in turn with every buffer of a page or more on a page (`cpu.alignment`, what
`measure`, `run` and the library's calls do) and with every buffer on a cache line only (numpy's
placement, as before), alternating, `--runs` of each.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_alignment.py [--runs 3] [--budget 0.2]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics

import numpy as np

from fusesearch.api import plan as make_plan
from fusesearch.backends import cpu
from fusesearch.backends.codegen import generate
from fusesearch.backends.timing import measure_interleaved
from fusesearch.groups import FusionGroup
from fusesearch.lowering import lower
from fusesearch.measure import measure_plan
from fusesearch.pipeline import prepare

GELU = ("div_3", "erf_0", "add_13", "mul_3")  # bert-small's first GELU: four ops, one generated call
OFFSETS = (0, 64, 128, 192, 256, 512, 1024, 2048)  # bytes the output starts past the input, modulo 4 KiB


def gelu_at_offsets(budget: float) -> None:
    prep = prepare("zoo:bert-small")
    ids = {node.name: node.id for node in prep.graph.nodes}
    kernel = lower(prep.graph, FusionGroup(frozenset(ids[n] for n in GELU)))
    gk = generate(prep.graph, kernel)
    fn = getattr(cpu.compile_kernel(gk), gk.name)
    fn.restype = None
    (x_arg,) = [a for a in gk.inputs if prep.graph.constant_value(a.tensor) is None]  # the constants are literals
    n = int(np.prod(x_arg.shape))
    span = -(-4 * n // cpu.PAGE) * cpu.PAGE + cpu.PAGE  # the input, then the output at its offset
    keep, runs = [], []
    for offset in OFFSETS:
        block = cpu.aligned_empty(2 * span).view(np.float32)
        block[:n] = np.random.default_rng(0).standard_normal(n, dtype=np.float32) * 3
        x, y = block[:n], block[(span + offset) // 4:(span + offset) // 4 + n]
        scalars = {a.tensor: cpu.aligned_array(a.shape, np.float32, prep.graph.constant_value(a.tensor))
                   for a in gk.inputs if a is not x_arg}
        pointers = [(x if a is x_arg else scalars[a.tensor]).ctypes.data_as(ctypes.c_void_p) for a in gk.inputs]
        pointers.append(y.ctypes.data_as(ctypes.c_void_p))
        keep.append((block, scalars))
        runs.append(lambda p=pointers: fn(*p))
    times = [t.median_s for t in measure_interleaved(runs, budget_s=budget * len(runs), rounds=5)]
    print(f"1. bert-small's GELU over {x_arg.shape} (one fs_gelu2f call per element), its output this many "
          f"bytes past its input modulo 4 KiB:")
    for offset, t in zip(OFFSETS, times, strict=True):
        print(f"   {offset:5d} B   {t * 1e6:7.2f} us   {t / times[0]:.3f}x the time at 0")


def plan_by_alignment(runs: int, budget: float) -> None:
    prep = prepare("zoo:bert-small")
    plan = make_plan("zoo:bert-small", device="host", strategy="cpsat", prepared=prep)
    none = make_plan("zoo:bert-small", device="host", strategy="none", prepared=prep, lone_anchors="library")
    page, line = cpu.alignment, (lambda nbytes: cpu.ALIGN)
    found: dict[str, list[tuple[float, float, float]]] = {"page": [], "cache line": []}
    try:
        for r in range(runs):
            for mode in (("page", "cache line") if r % 2 == 0 else ("cache line", "page")):
                cpu.alignment = page if mode == "page" else line
                t = measure_plan(prep, plan, none, "cpu", budget_s=budget).totals()
                found[mode].append((t["measured_s"], t["unfused_measured_s"], t["speedup"]))
    finally:
        cpu.alignment = page
    print(f"2. bert-small, cpsat plan vs unfused graph (measure_plan), {runs} runs each way, alternating:")
    for mode, rows in found.items():
        plan_s, unfused_s, speedup = (statistics.median(row[i] for row in rows) for i in range(3))
        print(f"   buffers of a page or more on a {mode:10s}  plan {plan_s * 1e3:.3f} ms  unfused {unfused_s * 1e3:.3f} ms  "
              f"speedup {speedup:.3f}x  (runs: {', '.join(f'{row[2]:.3f}x' for row in rows)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.2)
    args = parser.parse_args()
    if not cpu.available():
        raise SystemExit(f"no C compiler: {cpu.available().reason}")
    gelu_at_offsets(args.budget)
    plan_by_alignment(args.runs, args.budget)


if __name__ == "__main__":
    main()
