"""What the cost model's error costs, per zoo model: the plan chosen by predicted costs and the plan
chosen by measured costs (`--costs measured`), each run end to end on this CPU, interleaved
(`fusesearch.regret`; figures printed, the target reported, not asserted).

Target: the measured-cost plan is never slower than the predicted-cost plan beyond the measured
noise (the verdict is "predicted plan faster" only when their p20-p80 ranges do not overlap).
Measuring the choices is cached in the timing database, so a second run of this script only runs
the programs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_regret.py [--models bert-small,resnet18]
                                                                   [--strategy cpsat] [--repeat 20]
"""

from __future__ import annotations

import argparse
import json

from fusesearch.regret import regret

DEFAULT_MODELS = "bert-small,resnet18,mobilenetv2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--strategy", default="cpsat")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="one JSON document per model instead of the table")
    args = parser.parse_args()
    print(f"{'model':<14} {'predicted plan':>22} {'measured plan':>22} {'ratio':>6} {'noise':>9}  verdict")
    met = True
    for name in args.models.split(","):
        r = regret(f"zoo:{name}", "host", args.strategy, repeat=args.repeat)
        if args.json:
            print(json.dumps(r.to_dict(), sort_keys=True))
            continue
        p, m = r.plans["predicted"], r.plans["measured"]
        cells = [f"{q['median_s'] * 1e3:.3f} ms ({q['p20_s'] * 1e3:.3f}-{q['p80_s'] * 1e3:.3f})" for q in (p, m)]
        print(f"{name:<14} {cells[0]:>22} {cells[1]:>22} {p['median_s'] / m['median_s']:>5.2f}x "
              f"{r.noise_s * 1e3:>6.3f} ms  {r.verdict}{' (same plan)' if r.same_plan else ''}")
        met &= r.verdict != "predicted plan faster"
    if not args.json:
        print(f"target (measured-cost plan never slower beyond the noise): {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
