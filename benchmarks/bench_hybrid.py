"""hybrid against measured costs, per zoo model: the share of the choices hybrid times, how long
measuring took, and its plan run end to end beside the measured-cost plan, interleaved
(`--costs hybrid|measured`, `fusesearch.autotune`; figures printed, the target reported, not
asserted).

Target: hybrid times <= 25% of the choices and its plan runs within 2% of the measured-cost
plan's time, round by round (`timing.paired`: the median of the per-round ratios within 1.02x,
or their p20-p80 range holds 1: not distinguishable).
The measured-cost plan reads the cache folder's timing database (fill it first: `fusesearch plan
zoo:M --device host --costs measured`). By default hybrid reads the same database, so both plans
are chosen from the same measurements and the comparison is of what hybrid chooses to time, not
of two sessions' noise ("timed" counts the choices it timed or read); `--cold` gives hybrid an
empty database of its own, so its "measuring took" is what a first hybrid plan costs (the
compiled kernels are reused). "at measured costs" is hybrid's plan priced by the measured-cost
search's times (the sum of its kernels, each in its layout, and its reorders) over the measured
plan's: no run-to-run noise.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_hybrid.py [--models bert-small,resnet18]
                                              [--repeat 20] [--cold] [--device host|profile.json]
                                              [--markdown FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from benchutil import header, host_plan, spread, zoo_models

from fusesearch.backends.timing import TimingCache
from fusesearch.pipeline import prepare
from fusesearch.regret import same_plan
from fusesearch.run import run_plan

MAX_TIMED = 0.25
WITHIN = 1.02


def bench(name: str, repeat: int, cold: bool, device: str = "host") -> dict:
    prep = prepare(f"zoo:{name}")
    measured, problem = host_plan(prep, "measured", device=device)
    with tempfile.TemporaryDirectory(prefix="hybrid-db-") as folder:
        began = time.perf_counter()
        hybrid, _ = host_plan(prep, "hybrid", cache=TimingCache(folder) if cold else None, device=device)
        hybrid_s = time.perf_counter() - began
    groups = [frozenset(g.nodes) for g in hybrid.groups]  # each in the layout hybrid's plan runs it, reorders too
    blocked = [n for n, g in zip(groups, hybrid.groups, strict=True)
               if g.kernel.schedule.layout_in.blocked or g.kernel.schedule.layout_out.blocked]
    at_measured = problem.plan_time_s(groups, blocked) / measured.time_s
    report = run_plan(prep, hybrid, measured, threads=1, repeat=repeat, warmup=3,
                      names={"plan": "hybrid-cost plan's", "unfused": "measured-cost plan's"})
    h, m = report.timings["plan"], report.timings["unfused"]
    t = dict(hybrid.tuning)
    return {"model": name, "choices": t["choices"], "timed": t["measured"] + t["from_database"],
            "lone": t.get("lone_choices", 0), "outside": t.get("outside_band", 0), "band": t.get("band"),
            "load": os.getloadavg()[0],
            "fraction": t["timed_fraction"], "measuring_s": t["wall_s"], "rounds": t["rounds"],
            "hybrid_plan_s": hybrid_s, "at_measured": at_measured,
            "kernels": (hybrid.kernels, measured.kernels),
            "hybrid": (h.median_s, h.p20_s, h.p80_s), "measured": (m.median_s, m.p20_s, m.p80_s),
            "pair": report.paired("plan", "unfused"), "same": same_plan(hybrid, measured), "n": h.n}


def row(r: dict) -> str:
    pair = r["pair"]
    verdict = pair.compared("hybrid faster", "hybrid slower")
    if verdict == "hybrid slower" and pair.median <= WITHIN:
        verdict = "within 2%"
    verdict += " (same plan)" if r["same"] else ""
    met = r["fraction"] <= MAX_TIMED and verdict.split(" (")[0] != "hybrid slower"
    return (f"| {r['model']} | {r['timed']}/{r['choices']} ({r['fraction']:.1%}) | {r['lone']} | {r['outside']} | "
            f"{r['band']:.2f}x | {r['rounds']} | "
            f"{r['measuring_s']:.1f} s | {r['at_measured']:.3f}x | {spread(*r['hybrid'])} | {spread(*r['measured'])} | "
            f"{pair.text(3)} | "
            f"{verdict} | {'met' if met else 'NOT met'} | {r['load']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(zoo_models()))
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--cold", action="store_true", help="hybrid starts from an empty timing database")
    parser.add_argument("--device", default="host", help="host, or a host profile.json (its fitted efficiencies "
                        "price what is not measured, its held-out error sets hybrid's band)")
    parser.add_argument("--markdown", help="append the table to this file (with the command and machine)")
    args = parser.parse_args()
    lines = ["| model | choices timed by hybrid | of them a group's only one | kept predicted outside the band | band "
             "| searches | measuring took | at measured costs | hybrid plan, ms | measured plan, ms | per round | verdict | "
             "target | load |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    print("\n".join(lines), flush=True)
    for name in args.models.split(","):
        try:
            lines.append(row(bench(name, args.repeat, args.cold, args.device)))
        except Exception as exc:  # a model that cannot plan or run here: said, and the others go on
            lines.append(f"| {name} | skipped: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]} |")
        print(lines[-1], flush=True)
    if args.markdown:
        with open(args.markdown, "a", encoding="utf-8") as out:
            out.write(header("hybrid against measured costs", " ".join(["python", *sys.argv])) + "\n"
                      + "\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
