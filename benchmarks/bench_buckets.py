"""The price of one plan: for each model and device, one plan over a range of one dim (`plan --dim
seq=16..512`) beside each bucket's own optimal plan, predicted by the cost model (no timing, so the
figures are the same on any machine for the same flags).

    .venv/bin/python benchmarks/bench_buckets.py                       # bert-base, gpt2, vit-base
    .venv/bin/python benchmarks/bench_buckets.py --models bert-small --devices h100-sxm --strategy greedy
    .venv/bin/python benchmarks/bench_buckets.py --emit       # every zoo model's dynamic fused ONNX, verified
    .venv/bin/python benchmarks/bench_buckets.py --solve-time # one plan over 5 buckets against one bucket's
    .venv/bin/python benchmarks/bench_buckets.py --compile    # what a program per bucket costs to compile

Prints one row per bucket: its weight, its time under the one plan and under its own plan, the
price (one plan / own plan) and, where a bucket pays more than the target, the refusals that kept
its own groups out of the one plan; then where the buckets' own plans change (fused groups gained
and lost from the bucket below, and what the plan below costs there over the bucket's own). With `--emit`, each zoo model with a dynamic dim is planned
(greedy, h100-sxm) over a range of it and its one fused model, keeping the dim dynamic, is verified in
ONNX Runtime at 4 shapes in the range (`plan --dim ... --emit`). With `--solve-time`, the time to solve
one plan over seq = 32..512 (5 buckets) of bert-base against one bucket's (seq=128) solve, cpsat at
1 worker, and the whole `plan --dim` (with each bucket's own plan); the load average is printed, as
the machine may be shared. Target: the joint solve within 3x one bucket's.

With `--compile`, why `run --dim` builds one program per bucket: bert-small at seq 16, 128 and 512,
one plan (host, greedy); each bucket's generated C kernels compiled cold (an empty cache, one after
another), how many of them another bucket already compiled (the same source), and each bucket's
program run beside ONNX Runtime. Every extent in a generated kernel is a constant (loop bounds, row
lengths, strides), which is what its vectorized and unrolled loops are built on; a kernel reading
the extent at run time would compile once for all buckets, the trade printed at the end. The
kernels whose sources at the smallest and largest bucket differ only in their row count (pointwise
and rowwise loops over rows of the sequence) are then timed at the largest bucket as generated and
with that row count read from a global at run time, interleaved: what making them dynamic costs.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from fusesearch.backends.codegen import NP_DTYPES  # noqa: E402
from fusesearch.backends.timing import measure_interleaved  # noqa: E402
from fusesearch.buckets import plan_buckets, plan_changes, split_dims  # noqa: E402
from fusesearch.ir.shapes import ShapeBindings  # noqa: E402
from fusesearch.pipeline import prepare  # noqa: E402
from fusesearch.search import SearchConfig  # noqa: E402

DIMS = {"bert-base": "seq=16..512", "gpt2": "seq=16..512", "vit-base": "batch=1..32", "bert-small": "seq=16..512"}
EMIT_DIMS = {"resnet18": "batch=1..8", "resnet50": "batch=1..8", "mobilenetv2": "batch=1..8", "vit-small": "batch=1..8",
             "vit-base": "batch=1..8", "bert-base": "seq=16..512", "bert-small": "seq=16..512", "gpt2": "seq=16..512",
             "unet": "batch=1..4", "yolo-neck": "batch=1..4", "rnn-control": "batch=1..4"}
TARGET = 1.05


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="bert-base,gpt2,vit-base")
    parser.add_argument("--devices", default="h100-sxm,h200,host")
    parser.add_argument("--strategy", default="cpsat")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--emit", action="store_true", help="verify every zoo model's dynamic fused ONNX instead")
    parser.add_argument("--solve-time", action="store_true", help="time one plan over 5 buckets against one bucket")
    parser.add_argument("--compile", action="store_true", help="the compile cost of a program per bucket")
    args = parser.parse_args(argv)
    if args.emit:
        return emit_all()
    if args.compile:
        return compile_cost()
    if args.solve_time:
        return solve_time(args.models.split(",")[0] if args.models != parser.get_default("models") else "bert-base",
                          args.devices.split(",")[0], args.strategy, args.time_limit)
    config = SearchConfig(time_limit_s=args.time_limit, workers=1)
    print(f"{'model':<11} {'device':<9} {'bucket':>12} {'weight':>6} {'one plan':>10} {'own plan':>10} {'price':>7}")
    for name in args.models.split(","):
        _, buckets = split_dims([DIMS[name]])
        preps = [prepare(f"zoo:{name}", ShapeBindings.parse([], [f"{buckets.dim}={v}"])) for v in buckets.values]
        for device in args.devices.split(","):
            start = time.perf_counter()
            plan, figures, _ = plan_buckets(preps, buckets, device, args.strategy, config)
            wall = time.perf_counter() - start
            for f in figures:
                flag = "" if f.price <= TARGET else "  over target"
                print(f"{name:<11} {device:<9} {buckets.dim + '=' + str(f.value):>12} {f.weight:6.3f} "
                      f"{f.time_s * 1e6:8.1f}us {f.own_time_s * 1e6:8.1f}us {f.price:6.3f}x{flag}")
                for why in f.why[:3] if f.price > TARGET else ():
                    print(f"{'':<34}own groups refused {why}")
                if f.price > TARGET and f.own_weighted_s is not None:
                    print(f"{'':<34}its own plan served at every bucket: {f.own_weighted_s * 1e6:.1f}us weighted, "
                          f"the one plan {plan.time_s * 1e6:.1f}us")
            worst = max(figures, key=lambda f: f.price)
            print(f"{name:<11} {device:<9} one plan: {plan.kernels} kernels, solver {plan.solver.status}, "
                  f"worst {buckets.dim}={worst.value} {worst.price:.3f}x, {wall:.0f} s")
            changed = [c for c in plan_changes(figures) if c.gone or c.new]
            print(f"{'':<22}own plans change: " + (", ".join(
                f"{c.low}->{c.high} +{len(c.new)}/-{len(c.gone)} (the plan below there "
                f"{'refused' if c.price is None else f'{c.price:.3f}x'})" for c in changed) or "nowhere"))
    return 0


SOLVE_DIMS = "seq=32..512"  # 5 buckets
SOLVE_ONE = 128  # the bucket solved alone
SOLVE_TARGET = 3.0


def solve_time(name: str, device: str, strategy: str, time_limit: float) -> int:
    """One bucket's solve (plan at seq=128) against the joint solve over SOLVE_DIMS, then the whole
    plan over the buckets with each bucket's own optimum; 1 solver worker, load average printed."""
    import os

    from fusesearch.api import plan as api_plan

    _, buckets = split_dims([SOLVE_DIMS])
    preps = [prepare(f"zoo:{name}", ShapeBindings.parse([], [f"{buckets.dim}={v}"])) for v in buckets.values]
    one_prep = preps[buckets.values.index(SOLVE_ONE)]
    load = os.getloadavg()
    start = time.perf_counter()
    one = api_plan(f"zoo:{name}", device, strategy, prepared=one_prep, workers=1, time_limit_s=time_limit)
    one_wall = time.perf_counter() - start
    start = time.perf_counter()
    joint, figures, _ = plan_buckets(preps, buckets, device, strategy,
                                     SearchConfig(time_limit_s=time_limit, workers=1))
    whole = time.perf_counter() - start
    ratio = joint.solver.wall_s / one.solver.wall_s
    print(f"{name} {device} {strategy}, 1 worker, load average {load[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"  one bucket ({buckets.dim}={SOLVE_ONE}): solve {one.solver.wall_s:.1f} s ({one.solver.status}), "
          f"plan {one_wall:.1f} s")
    print(f"  one plan over {buckets.dim} = {', '.join(map(str, buckets.values))}: joint solve "
          f"{joint.solver.wall_s:.1f} s ({joint.solver.status}) = {ratio:.2f}x one bucket's "
          f"(target {SOLVE_TARGET:.0f}x: {'met' if ratio <= SOLVE_TARGET else 'NOT met'})")
    print(f"  with each bucket's own optimum (the price of one plan): {whole:.1f} s = "
          f"{whole / one_wall:.2f}x one bucket's plan")
    return 0 if ratio <= SOLVE_TARGET else 1


COMPILE_MODEL, COMPILE_DIMS = "bert-small", "seq=16,128,512"


def compile_cost(repeat: int = 10) -> int:
    """Each bucket's program of one plan over COMPILE_DIMS: its kernels compiled cold, those another
    bucket already compiled, and its run beside ONNX Runtime (1 thread, median of `repeat`)."""
    import os
    import tempfile

    from fusesearch.backends import cpu
    from fusesearch.buckets import bucket_programs
    from fusesearch.run import _flags, _object, plan_steps, run_plan

    _, buckets = split_dims([COMPILE_DIMS])
    preps = [prepare(f"zoo:{COMPILE_MODEL}", ShapeBindings.parse([], [f"{buckets.dim}={v}"])) for v in buckets.values]
    plan, _, problems = plan_buckets(preps, buckets, "host", "greedy", SearchConfig(workers=1))
    flags, _ = _flags()
    seen: set[str] = set()
    rows, sources, largest_kernels, compile_times = [], [], [], []
    print(f"{COMPILE_MODEL}, one plan ({plan.kernels} kernels) for {buckets.dim} = "
          f"{', '.join(map(str, buckets.values))}, load average {os.getloadavg()[0]:.1f}")
    print(f"{'bucket':>10} {'kernels':>7} {'new':>5} {'compile cold':>12} {'plan':>10} {'ORT':>10} {'plan/ORT':>8}")
    with tempfile.TemporaryDirectory() as cold:
        for value, (prep, ours, unfused) in zip(buckets.values, bucket_programs(problems, plan, "host"), strict=True):
            kernels = [s.kernel for s in plan_steps(prep.graph, ours) if s.kernel is not None]
            sources.append([k.c_source for k in kernels])
            largest_kernels = kernels
            new = [k for k in kernels if k.source_hash not in seen]
            seen.update(k.source_hash for k in kernels)
            spent = {}
            for k in new:  # one after another: the compile's CPU time, not the pool's wall
                start = time.perf_counter()
                _object(k.c_source, k.name, flags, Path(cold))
                spent[k.source_hash] = time.perf_counter() - start
            compile_times.append([spent.get(k.source_hash, 0.0) for k in kernels])
            compile_s = sum(spent.values())
            report = run_plan(prep, ours, unfused, threads=1, repeat=repeat, seed=0)
            plan_s, ort_s = report.timings["plan"].median_s, report.timings[report.ort_baseline()].median_s
            rows.append((value, len(kernels), len(new), compile_s, plan_s))
            print(f"{buckets.dim + '=' + str(value):>10} {len(kernels):7d} {len(new):5d} {compile_s:10.1f} s "
                  f"{plan_s * 1e3:8.2f}ms {ort_s * 1e3:8.2f}ms {plan_s / ort_s:7.2f}x")
    total = sum(r[3] for r in rows)
    shared = sum(r[1] - r[2] for r in rows)
    print(f"a program per bucket: {total:.1f} s of compiling, once per plan (objects cached by their source "
          f"under {cpu.cache_dir()}), {shared} kernels shared with a smaller bucket")
    outer = row_bound_only(sources[0], sources[-1])
    if outer is None:
        return 0
    saved = sum(times[i] for times in compile_times[:-1] for i in outer)
    print(f"kernels whose {buckets.dim}={buckets.values[0]} and {buckets.dim}={buckets.values[-1]} sources differ only "
          f"in their row count (cheap to read at run time): {len(outer)} of {len(sources[0])}; the others carry "
          f"{buckets.dim} in index arithmetic, row lengths, stack buffers or GEMM tiles; compiling those "
          f"{len(outer)} once instead of per bucket saves {saved:.1f} s of the {total:.1f} s")
    ratios = []
    for i in outer:  # at the largest bucket: the kernel as generated against its row count read at run time
        kernel = largest_kernels[i]
        static, dynamic = kernel_runner(kernel), kernel_runner(kernel.with_c_source(rows_at_run_time(kernel.c_source)))
        static(), dynamic()
        if not all(np.array_equal(a, b, equal_nan=True) for a, b in zip(static.buffers, dynamic.buffers, strict=True)):
            print(f"  {kernel.name}: its outputs differ with the row count read at run time")
            return 1
        fixed, read = measure_interleaved([static, dynamic], budget_s=0.5, rounds=5)
        ratios.append(read.median_s / fixed.median_s)
        print(f"  {kernel.name:<28} rows constant {fixed.median_s * 1e6:8.1f} us, read at run time "
              f"{read.median_s * 1e6:8.1f} us ({ratios[-1]:.3f}x)")
    if ratios:
        print(f"those kernels with their row count read at run time, at {buckets.dim}={buckets.values[-1]}: "
              f"median {statistics.median(ratios):.3f}x, {min(ratios):.3f}x to {max(ratios):.3f}x of the constant's time")
    return 0


def rows_at_run_time(source: str) -> str:
    """The kernel's row counts (`ROW_BOUNDS`) read from globals the compiler cannot see through."""
    found: list[str] = []

    def read(match) -> str:
        found.append(match.group(0)[len(match.group(1)):])
        return f"{match.group(1)}fs_rows_{len(found) - 1}"

    for pattern in ROW_BOUNDS:
        source = pattern.sub(read, source)
    return "".join(f"long long fs_rows_{i} = {v};\n" for i, v in enumerate(found)) + source


def kernel_runner(kernel):
    """The kernel compiled, on seeded inputs of its shapes (timing only: their values do not matter)."""
    from fusesearch.backends import cpu

    rng = np.random.default_rng(0)
    inputs = {a.tensor: rng.standard_normal(a.shape).astype(np.float32) if a.dtype == "float32"
              else np.zeros(a.shape, dtype=NP_DTYPES[a.dtype]) for a in kernel.inputs}
    return cpu.runner(kernel, inputs)


# the row count of a kernel's parallel loop over rows: its bound, and a rowwise kernel's clamp of
# its second row of a pair
ROW_BOUNDS = (re.compile(r"(#pragma omp for[^\n]*\n\s*for \(long long (\w+) = 0; \2 < )\d+LL"),
              re.compile(r"(\br_0 \+ 1 < )\d+LL"))


def row_bound_only(low: list[str], high: list[str]) -> list[int] | None:
    """The kernels (paired in plan order, their indices) that differ between two buckets only in
    their row count (`ROW_BOUNDS`); None where the programs do not pair up."""
    def rows_out(source: str) -> str:
        for pattern in ROW_BOUNDS:
            source = pattern.sub(r"\1N", source)
        return source

    if len(low) != len(high):
        return None
    return [i for i, (a, b) in enumerate(zip(low, high, strict=True)) if a != b and rows_out(a) == rows_out(b)]


def emit_all() -> int:
    """Each zoo model with a dynamic dim: its one fused model over a range, verified at 4 shapes."""
    import json
    import subprocess
    import tempfile

    failed = 0
    for name, dim in EMIT_DIMS.items():
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "fusesearch", "plan", f"zoo:{name}", "--device", "h100-sxm", "--strategy",
                   "greedy", "--dim", dim, "--emit", f"{tmp}/fused.onnx", "--json"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            failed += 1
            print(f"{name:<12} {dim:<14} not emitted: {proc.stderr.strip().splitlines()[-1]}")
            continue
        verified = json.loads(proc.stdout)["run"]["verified"]
        shapes = ", ".join(f"{r['at']}{'' if r['ok'] else ' DIFFERS'}" for r in verified)
        print(f"{name:<12} {dim:<14} verified at {dim.split('=')[0]} = {shapes}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
