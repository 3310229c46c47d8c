"""What the cost model's error costs, per zoo model: the plan chosen by predicted costs and the plan
chosen by measured costs (`--costs measured`), each run end to end on this CPU, interleaved
(`fusesearch.regret`; figures printed, the target reported, not asserted).

Target: the measured-cost plan is never slower than the predicted-cost plan beyond the measured
noise (the verdict is "predicted plan faster" only when the predicted plan's time over the
measured one's, round by round, has its p20-p80 range below 1: `timing.paired`).
Measuring the choices is cached in the timing database, so a second run of this script only runs
the programs. Every zoo model by default; one that cannot plan or run here is listed as skipped,
with why.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_regret.py [--models bert-small,resnet18]
                                         [--strategy cpsat] [--repeat 20] [--json] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

from benchutil import header, spread, zoo_models

from fusesearch.backends.timing import Paired
from fusesearch.regret import regret


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(zoo_models()))
    parser.add_argument("--strategy", default="cpsat")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="one JSON document per model instead of the table")
    parser.add_argument("--markdown", help="append the table to this file (with the command and machine)")
    args = parser.parse_args()
    lines = ["| model | predicted-cost plan, ms | measured-cost plan, ms | ratio | per round | noise, ms | verdict |",
             "|---|---:|---:|---:|---:|---:|---|"]
    if not args.json:
        print("\n".join(lines), flush=True)
    met = True
    for name in args.models.split(","):
        try:
            r = regret(f"zoo:{name}", "host", args.strategy, repeat=args.repeat)
        except Exception as exc:  # a model that cannot plan or run here: said, and the others go on
            lines.append(f"| {name} | skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} |")
            print(lines[-1], flush=True)
            continue
        if args.json:
            print(json.dumps(r.to_dict(), sort_keys=True), flush=True)
        p, m = r.plans["predicted"], r.plans["measured"]
        cells = [spread(q["median_s"], q["p20_s"], q["p80_s"]) for q in (p, m)]
        rounds = Paired(**r.paired).text() if r.paired else "-"
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {p['median_s'] / m['median_s']:.2f}x | {rounds} | "
                     f"{r.noise_s * 1e3:.3f} | {r.verdict}{' (same plan)' if r.same_plan else ''} |")
        if not args.json:
            print(lines[-1], flush=True)
        met &= r.verdict != "predicted plan faster"
    summary = f"target (measured-cost plan never slower beyond the noise): {'met' if met else 'NOT met'}"
    if not args.json:
        print(summary)
    if args.markdown:
        with open(args.markdown, "a", encoding="utf-8") as out:
            out.write(header("Regret: predicted- against measured-cost plans", " ".join(["python", *sys.argv]))
                      + "\n" + "\n".join(lines) + f"\n\n{summary}\n\n")


if __name__ == "__main__":
    main()
