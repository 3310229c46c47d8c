"""Do fused groups beat the library call of their anchor plus the rest's kernels, with measured
costs? Per zoo model, every fused anchor group (a GEMM or conv with other ops) of the
measured-cost plan (`--costs measured`) is timed afresh beside ONNX Runtime's call of its anchor
alone and each other op's own kernel, interleaved, in `--rounds` rounds of their own (each an
`Autotuner.sample` call: net of the null calls, caches flushed); figures printed, the target
reported, not asserted.

Target: fused faster in >= 95% of the groups. Each round gives the ratio of library + rest (the
sum of the parts' medians that round) over fused (its median that round); a group counts as
"fused faster" when the p20 of those per-round ratios is above 1, "library + rest faster" when
their p80 is below 1, else "not distinguishable" (`timing.paired`'s rule: a shared machine's
slow spells stretch a round's figures alike); "fused median lower" counts the groups whose
median ratio is above 1, whatever the spread. The measured-cost plan reads the cache folder's timing database (fill it
first: `fusesearch plan zoo:M --device host --costs measured`).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_fused_groups.py [--models bert-small,resnet18]
                                          [--rounds 20] [--budget 0.2] [--markdown FILE] [--groups]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from benchutil import header, host_plan, zoo_models

from fusesearch.backends.timing import Timing, paired
from fusesearch.pipeline import prepare

TARGET = 0.95


def parts(legality, group) -> tuple[object | None, list]:
    """(the anchor's library call or None, each other op's own kernel as the measured search
    picks it; view ops, which run no kernel, left out)."""
    anchor = group.kernel.anchor
    options = legality.options(frozenset({anchor}), legality.check({anchor}).kernel)
    library = next((k for k in options if k.impl == "library"), None) if isinstance(options, tuple) else None
    rest = [legality.check({n}).kernel for n in group.nodes if n != anchor]
    return library, [k for k in rest if k is not None and not k.alias]


def bench(name: str, rounds: int, budget_s: float) -> tuple[dict, list[str]]:
    plan, problem = host_plan(prepare(f"zoo:{name}"), "measured")
    legality, tuner = problem.legality, problem.legality.measurer
    counts = {"groups": 0, "fused": 0, "not distinguishable": 0, "library + rest": 0, "no library call": 0,
              "not timed": 0, "fused median lower": 0}
    details = []
    for g in plan.groups:
        if g.kernel.anchor is None or len(g.nodes) < 2:
            continue
        counts["groups"] += 1
        library, rest = parts(legality, g)
        if library is None:
            counts["no library call"] += 1
            continue
        per_round, why = [], ""
        for _ in range(rounds):  # one interleaved round per call: (fused, library + rest) medians
            timings = tuner.sample([g.kernel, library, *rest], budget_s=budget_s / rounds, rounds=1)
            why = next((t for t in timings if isinstance(t, str)), "")
            if why:
                break
            per_round.append((timings[0].median_s, sum(t.median_s for t in timings[1:])))
        if why:
            counts["not timed"] += 1
            details.append(f"| {name} g{g.id} | {'+'.join(g.kernel.ops)} | not timed: {why[:100]} |")
            continue
        fused, split = (np.percentile([r[i] for r in per_round], (50, 20, 80)) for i in (0, 1))
        pair = paired(*(Timing(tuple(r[i] for r in per_round), 0, "round medians") for i in (1, 0)))
        verdict = pair.compared("library + rest", "fused")  # library + rest over fused
        counts[verdict] += 1
        counts["fused median lower"] += pair.median > 1
        details.append(f"| {name} g{g.id} | {'+'.join(g.kernel.ops)[:60]} | {fused[0] * 1e6:.1f} "
                       f"({fused[1] * 1e6:.1f}-{fused[2] * 1e6:.1f}) | {split[0] * 1e6:.1f} "
                       f"({split[1] * 1e6:.1f}-{split[2] * 1e6:.1f}) | {pair.text()} "
                       f"| {verdict} |")
    return counts, details


def row(name: str, c: dict) -> str:
    compared = c["fused"] + c["not distinguishable"] + c["library + rest"]
    share = c["fused"] / compared if compared else float("nan")
    return (f"| {name} | {c['groups']} | {c['fused']} | {c['not distinguishable']} | {c['library + rest']} | "
            f"{c['no library call'] + c['not timed']} | {share:.0%} | {c['fused median lower']}/{compared} | "
            f"{'met' if share >= TARGET else 'NOT met'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(zoo_models()))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--budget", type=float, default=0.2, help="seconds of samples per kernel, over the rounds")
    parser.add_argument("--markdown", help="append the tables to this file (with the command and machine)")
    parser.add_argument("--groups", action="store_true", help="also list every group")
    args = parser.parse_args()
    lines = ["| model | fused anchor groups | fused faster | not distinguishable | library + rest faster | "
             "not compared | fused faster, of compared | fused median lower | target |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    groups = ["| group | ops | fused, us | library + rest, us | ratio per round | verdict |",
              "|---|---|---:|---:|---:|---|"]
    print("\n".join(lines), flush=True)
    for name in args.models.split(","):
        try:
            counts, details = bench(name, args.rounds, args.budget)
            lines.append(row(name, counts))
            groups += details
        except Exception as exc:  # a model that cannot plan here: said, and the others go on
            lines.append(f"| {name} | skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} |")
        print(lines[-1], flush=True)
    if args.groups:
        print("\n".join(groups))
    if args.markdown:
        with open(args.markdown, "a", encoding="utf-8") as out:
            out.write(header("Fused groups against library + rest, measured costs", " ".join(["python", *sys.argv]))
                      + "\n" + "\n".join(lines) + "\n\n" + ("\n".join(groups) + "\n\n" if args.groups else ""))


if __name__ == "__main__":
    main()
