"""Every zoo plan at 1 and at 2 OpenMP threads, run end to end and interleaved (figures printed,
the target reported, not asserted).

For each zoo model (`host`, strategy cpsat): the plan priced for 1 thread run with 1 thread and the
plan priced for 2 threads (`--threads 2`: its thread splits) run with 2, each checked equal to
ONNX Runtime, then timed in turn, one run of each per round (`run._timed`), so a change in the
machine's load falls on both alike. Each program is built with per-kernel clocks
(`Program(profile=True)`): where 2 threads are not faster, the groups that lost most (their time at
2 threads over half their time at 1) say why. The load average before and after each model is
printed: with both CPUs of a 2-CPU machine busy elsewhere, the second thread mostly waits for a
core, and the figure must be taken again on a quiet machine.

Target: every plan faster at 2 threads than at 1, round by round (`timing.paired`: the p80 of
the per-round ratios of its time at 2 threads over its time at 1 below 1). `--costs
measured` (or hybrid) plans each thread count from its choices timed at that count
(`fusesearch.autotune`, the timing database in the cache folder), where a plan's few-microsecond
kernels are priced by more than the model's launch figures.

    .venv/bin/python benchmarks/bench_threads.py --models bert-small,resnet18 --repeat 10 [--costs measured] --markdown FILE
"""

from __future__ import annotations

import argparse
import os
import time

from benchutil import header, run_at, spread, zoo_models

from fusesearch.api import plan as make_plan
from fusesearch.backends.timing import paired
from fusesearch.errors import FusesearchError
from fusesearch.ir.precision import prepared_tolerance
from fusesearch.pipeline import prepare
from fusesearch.run import Program, _reference, _timed, checked, plan_steps, restore_threads

THREADS = (1, 2)
LOST = 3  # groups named per model that is not faster


def programs(prep, plans: dict[int, object]) -> tuple[dict[int, Program], dict]:
    """The plans' C programs (per-kernel clocks on), each checked equal to ONNX Runtime, and the
    inputs they run on."""
    canonical, weights, feeds, reference = _reference(prep, {f"{n} threads": p for n, p in plans.items()}, 0, None)
    built = {}
    for n, p in plans.items():
        steps = plan_steps(prep.graph, p)
        built[n], _, _ = checked(f"{n}-thread", lambda reuse, steps=steps, n=n: Program(
            prep.graph, canonical, steps, weights, n, reuse=reuse, profile=True),
            canonical, feeds, reference, prepared_tolerance(prep), False)
    return built, feeds


def lost(built: dict[int, Program], plans: dict[int, object], repeat: int) -> list[str]:
    """The groups of the 2-thread plan that lost most against half their time in the 1-thread plan
    (the same nodes there; per run), as text."""
    one, two = (built[n].kernel_seconds() for n in THREADS)
    at_one = {frozenset(g.nodes): one.get(g.id, 0.0) for g in plans[1].groups}
    rows = sorted(((seconds - at_one[frozenset(g.nodes)] / 2, g, seconds) for g in plans[2].groups
                   if (seconds := two.get(g.id)) is not None and frozenset(g.nodes) in at_one),
                  key=lambda r: r[0], reverse=True)
    return [f"g{g.id} {'+'.join(g.kernel.ops)[:48]}: {two_s / repeat * 1e6:.0f} us at 2 threads, {d / repeat * 1e6:.0f} us "
            "above half its 1-thread time" for d, g, two_s in rows[:LOST]]


def bench(name: str, repeat: int, warmup: int, time_limit: float, costs: str = "predicted") -> dict:
    load_before = os.getloadavg()[0]
    prep = prepare(f"zoo:{name}")
    plans = {n: make_plan(f"zoo:{name}", device="host", strategy="cpsat", prepared=prep, time_limit_s=time_limit,
                          threads=n, costs=costs) for n in THREADS}
    built, feeds = programs(prep, plans)
    runs = {n: run_at(built[n], n, feeds) for n in THREADS}
    try:
        for go in runs.values():
            for _ in range(warmup):
                go()
        for program in built.values():  # the warm-up runs out of the per-kernel sums
            program.kernel_seconds(reset=True)
        timings = _timed(runs, 0, repeat)
    finally:
        restore_threads()
    t1, t2 = timings[1], timings[2]
    pair = paired(t2, t1)
    verdict = pair.compared("faster", "slower")
    return {"model": name, "t1": (t1.median_s, t1.p20_s, t1.p80_s), "t2": (t2.median_s, t2.p20_s, t2.p80_s),
            "speedup": t1.median_s / t2.median_s, "pair": pair, "faster": verdict == "faster", "verdict": verdict,
            "kernels": (plans[1].kernels, plans[2].kernels), "load": (load_before, os.getloadavg()[0]),
            "why": [] if verdict == "faster" else lost(built, plans, repeat)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(zoo_models()))
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--costs", default="predicted", choices=("predicted", "measured", "hybrid"),
                        help="what prices each plan's choices (measured: timed at its thread count)")
    parser.add_argument("--markdown", help="write the table to this file (with the command and machine)")
    args = parser.parse_args()
    lines = ["| model | 1 thread, ms | 2 threads, ms | 1 / 2 | 2 / 1 per round | verdict | kernels (1 / 2) | "
             "load before / after |", "|---|---:|---:|---:|---:|---|---:|---|"]
    print("\n".join(lines), flush=True)
    notes = []
    for name in args.models.split(","):
        began = time.perf_counter()
        try:
            r = bench(name, args.repeat, args.warmup, args.time_limit, args.costs)
        except FusesearchError as exc:
            lines.append(f"| {name} | FAILED: {exc} | | | | | | |")
            print(lines[-1], flush=True)
            continue
        lines.append(f"| {name} | {spread(*r['t1'])} | {spread(*r['t2'])} | {r['speedup']:.2f}x | {r['pair'].text()} | "
                     f"{r['verdict']} | "
                     f"{r['kernels'][0]} / {r['kernels'][1]} | {r['load'][0]:.1f} / {r['load'][1]:.1f} |")
        print(lines[-1] + f"  ({time.perf_counter() - began:.0f} s)", flush=True)
        notes += [f"- {name}: {why}" for why in r["why"]]
        for why in r["why"]:
            print(f"    {why}", flush=True)
    missed = [line.split("|")[1].strip() for line in lines[2:] if "| faster |" not in line]
    summary = ("every plan faster at 2 threads" if not missed else
               f"not faster at 2 threads: {', '.join(missed)}")
    print(summary)
    print("\n".join(notes))
    if args.markdown:
        command = ("OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_threads.py "
                   f"--models {args.models} --repeat {args.repeat} --costs {args.costs}")
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(header("Plans at 1 and 2 threads, interleaved", command) + "\n" + "\n".join(lines)
                    + f"\n\n{summary}\n\nWhere 2 threads lost most (per run):\n\n" + "\n".join(notes) + "\n")


if __name__ == "__main__":
    main()
