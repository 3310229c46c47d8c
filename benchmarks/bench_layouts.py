"""Layouts chosen by the exact search: planning time with and without, and a CNN run both ways (figures printed, never asserted).

Planning: each model planned by cpsat with `--layouts nchw` and `auto`, each plan in a process of
its own (the search timed, not the loading), the two interleaved round by round; the median and
p20-p80 per mode and their ratio (target: auto at most 2x nchw). Run: the model's plan with layouts
and without, one program each, checked equal to ONNX Runtime and timed in the same interleaved
rounds as ONNX Runtime ENABLE_ALL (`run.run_plan`, the nchw plan in the unfused slot), one OpenMP
thread; the reorders' measured seconds beside their predicted ones (`Program.kernel_seconds`).
`--factors depthwise=0.41,nchwc=0.8` prices with those product efficiencies (bench_nchwc's
measurements: the NCHW depthwise loop 0.41x the blocked one's rate, dense NCHWc 0.8x); without,
the host's defaults (`HOST_PRODUCT_EFFICIENCY`). The host's own lanes and blocks either way (16 with
AVX-512, 8 with AVX2: a 16-lane plan on an AVX2 machine runs its blocks of 16 as pairs of
vectors, yolo-neck's 20x slower).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_layouts.py [--models resnet50,yolo-neck]
        [--rounds 5] [--workers 1] [--run mobilenetv2] [--repeat 20] [--factors depthwise=0.41,nchwc=0.8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import numpy as np
from benchutil import header

HERE = os.path.dirname(os.path.abspath(__file__))


def _model(factors: dict):
    from costmodels import RooflineModel
    from costmodels.roofline import host_params

    return RooflineModel(host_params().with_updates(product_efficiency=factors) if factors else host_params())


def _device():
    from costmodels.devices import get_device

    return get_device("host", 1)


def _plan(prep, layouts: str, factors: dict, workers: int):
    from fusesearch.search import search
    from fusesearch.search.problem import SearchConfig

    return search(prep.graph, _device(), _model(factors), "cpsat", config=SearchConfig(layouts=layouts, workers=workers))


def plan_once(model: str, layouts: str, factors: dict, workers: int) -> dict:
    """One planning in this process: its seconds and what it chose."""
    import time

    from fusesearch.pipeline import prepare

    prep = prepare(f"zoo:{model}")
    start = time.perf_counter()
    plan = _plan(prep, layouts, factors, workers)
    return {"s": time.perf_counter() - start, "status": plan.solver.status, "time_s": plan.time_s,
            "blocked": sum(g.kernel.schedule.layout_out.blocked for g in plan.groups), "reorders": len(plan.reorders)}


def planning(models: list[str], rounds: int, factors: dict, workers: int) -> list[str]:
    found: dict[tuple, list[dict]] = {}
    for _ in range(rounds):
        for model in models:
            for layouts in ("nchw", "auto"):
                args = [sys.executable, __file__, "--one", model, layouts, json.dumps(factors), str(workers)]
                done = subprocess.run(args, capture_output=True, text=True, check=True, cwd=HERE)
                found.setdefault((model, layouts), []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    lines = ["| model | nchw (s) | auto (s) | auto/nchw | blocked groups | reorders | predicted nchw -> auto (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for model in models:
        n, a = found[(model, "nchw")], found[(model, "auto")]
        med = [statistics.median(r["s"] for r in rows) for rows in (n, a)]
        cell = [f"{m:.2f} ({np.percentile([r['s'] for r in rows], 20):.2f}-{np.percentile([r['s'] for r in rows], 80):.2f})"
                for m, rows in zip(med, (n, a), strict=True)]
        lines.append(f"| {model} | {cell[0]} | {cell[1]} | {med[1] / med[0]:.2f} | {a[0]['blocked']} | "
                     f"{a[0]['reorders']} | {n[0]['time_s'] * 1e3:.3f} -> {a[0]['time_s'] * 1e3:.3f} |")
    return lines


def run_both(model: str, repeat: int, factors: dict, workers: int) -> list[str]:
    from fusesearch.ir.canonicalize import to_proto
    from fusesearch.pipeline import prepare
    from fusesearch.run import Program, plan_steps, program_inputs, restore_threads, run_plan

    prep = prepare(f"zoo:{model}", keep_original=True)
    auto, nchw = (_plan(prep, layouts, factors, workers) for layouts in ("auto", "nchw"))
    report = run_plan(prep, auto, nchw, threads=1, repeat=repeat, warmup=3,
                      names={"plan": "layouts auto", "unfused": "layouts nchw"})
    _, weights, feeds = program_inputs(prep, 0, None)
    try:
        program = Program(prep.graph, to_proto(prep.canonical), plan_steps(prep.graph, auto), weights, 1, profile=True)
        program(feeds)
        program.kernel_seconds(reset=True)
        for _ in range(repeat):
            program(feeds)
        reorders_s = program.kernel_seconds().get(-1, 0.0) / repeat
    finally:
        restore_threads()
    lines = [f"{model}: auto {sum(g.kernel.schedule.layout_out.blocked for g in auto.groups)} of {len(auto.groups)} "
             f"groups blocked, {len(auto.reorders)} reorders; predicted auto {auto.time_s * 1e3:.3f} ms, nchw "
             f"{nchw.time_s * 1e3:.3f} ms; max rel err auto {report.max_rel_err:.2g}, nchw {report.unfused_max_rel_err:.2g}",
             f"reorders: measured {reorders_s * 1e3:.3f} ms, predicted {sum(r.cost.time_s for r in auto.reorders) * 1e3:.3f} ms",
             "", "| program | median (ms) | p20-p80 |", "|---|---:|---:|"]
    names = {"plan": "plan, layouts auto", "unfused": "plan, layouts nchw"}
    for key, timing in report.timings.items():
        s = np.array(timing.samples_s) * 1e3
        lines.append(f"| {names.get(key, key)} | {np.median(s):.3f} | {np.percentile(s, 20):.3f}-{np.percentile(s, 80):.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="resnet50,yolo-neck")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--run", default="mobilenetv2")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--factors", default="")
    parser.add_argument("--one", nargs=4)
    args = parser.parse_args()
    if args.one:
        model, layouts, factors, workers = args.one
        print(json.dumps(plan_once(model, layouts, json.loads(factors), int(workers))))
        return
    factors = {k: float(v) for k, v in (kv.split("=") for kv in args.factors.split(",") if kv)}
    print(header("Layouts chosen by the exact search", "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_layouts.py "
                 + " ".join(sys.argv[1:])))
    print(f"load average before: {os.getloadavg()[0]:.2f}\n")
    print("\n".join(planning(args.models.split(","), args.rounds, factors, args.workers)))
    if args.run:
        print()
        print("\n".join(run_both(args.run, args.repeat, factors, args.workers)))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
