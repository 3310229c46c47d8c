"""End-to-end benchmark: every zoo model's plan run as one program beside ONNX Runtime (figures
printed, targets reported, not asserted).

For each zoo model at its default dims (seq 128 where it has one): the plan (strategy, default
cpsat on the `host` device) and the unfused graph run as programs (`fusesearch.run`), checked
against ONNX Runtime, then timed with ONNX Runtime at ORT_ENABLE_ALL, ORT_ENABLE_EXTENDED (its
fusions without the NCHWc layout transformer) and ORT_DISABLE_ALL, their rounds
interleaved (`--threads`: the plans priced for that many threads and run with them, ONNX Runtime with as
many intra-op threads); each figure is printed as median (p20-p80), with the machine, and the plan's time
over ONNX Runtime ENABLE_ALL's round by round (`RunReport.paired`: median (p20-p80) of the
per-round ratios, which a shared machine's slow drifts stretch less than either figure; '~'
where that range holds 1: not distinguishable).
Targets (judged on the per-round median): plan <= 1.0x ENABLE_ALL on the transformers and the
CNNs, mobilenetv2 <= 0.9x; plan <= 0.8x unfused on the transformers; arena peak <= 60% of all
activations; equal to ONNX Runtime.

    .venv/bin/python benchmarks/bench_run.py [--models bert-small,resnet18] [--strategy cpsat]
                                             [--repeat 10] [--threads 1] [--time-limit 20]
"""

from __future__ import annotations

import argparse
import math
import time

from benchutil import machine, spread

from fusesearch import zoo
from fusesearch.api import plan as make_plan
from fusesearch.errors import FusesearchError
from fusesearch.pipeline import prepare
from fusesearch.run import run_plan

TRANSFORMERS = {"bert-small", "bert-base", "gpt2", "vit-small"}
CNNS = {"resnet18", "resnet50", "mobilenetv2", "yolo-neck", "unet"}
ARENA_TARGET = 0.60


def target(name: str) -> tuple[float | None, float | None]:
    """(plan / ORT ENABLE_ALL, plan / unfused) targets of this model, None where it has none."""
    if name in TRANSFORMERS:
        return 1.0, 0.8
    if name in CNNS:
        return (0.9 if name == "mobilenetv2" else 1.0), None
    return None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(e.name for e in zoo.list_models()))
    parser.add_argument("--strategy", default="cpsat")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=20.0)
    args = parser.parse_args()
    head = (f"{'model':<12} {'plan':>26} {'unfused':>26} {'ORT all':>26} {'ORT canon':>26} {'ORT ext':>26} "
            f"{'ORT none':>26} {'plan/ORT':>9} {'per round':>18} {'plan/ext':>9} {'plan/none':>9} {'plan/unf':>9} {'arena':>9} {'acts':>9} {'arena%':>7} "
            f"{'segs g/l':>8} {'equal':>6} {'wall':>6}")
    print(f"end to end on {machine()}, {args.threads} thread(s), strategy {args.strategy}: median (p20-p80) "
          f"in ms of {args.repeat} interleaved runs (ORT all = ORT_ENABLE_ALL on the model as given, ORT canon = "
          f"on the canonical model, ORT ext = ORT_ENABLE_EXTENDED on the model as given: no NCHWc transformer, "
          f"ORT none = ORT_DISABLE_ALL; plan/ORT: the medians' ratio against the faster ENABLE_ALL; per round: "
          f"the plan's time over it in the same round, median (p20-p80), '~' where that range holds 1: "
          f"not distinguishable)")
    print(head)
    missed = []
    for name in args.models.split(","):
        start = time.perf_counter()
        try:
            prep = prepare(f"zoo:{name}")
            p = make_plan(f"zoo:{name}", device="host", strategy=args.strategy, prepared=prep,
                          time_limit_s=args.time_limit, threads=args.threads)
            none = make_plan(f"zoo:{name}", device="host", strategy="none", prepared=prep, threads=args.threads)
            r = run_plan(prep, p, none, threads=args.threads, repeat=args.repeat, warmup=args.warmup)
        except FusesearchError as exc:
            print(f"{name:<12} FAILED: {exc}")
            missed.append(f"{name}: does not run or differs from ONNX Runtime")
            continue
        figures = {k: spread(v.median_s, v.p20_s, v.p80_s) for k, v in r.timings.items()}
        vs_unfused = r.ratio("plan", "unfused")
        pair = r.paired("plan", "ort_enable_all")
        vs_ort = pair.median
        rounds = pair.text()
        tied = " " if pair.distinguishable else "~"
        arena = r.arena_peak_bytes / r.activation_bytes if r.activation_bytes else math.nan
        print(f"{name:<12} {figures['plan']:>26} {figures['unfused']:>26} {figures['ort_enable_all']:>26} "
              f"{figures.get('ort_enable_all_canonical', '-'):>26} {figures['ort_enable_extended']:>26} "
              f"{figures['ort_disable_all']:>26} {r.ratio('plan', 'ort_enable_all'):>8.2f}x {tied}{rounds:>17} "
              f"{r.ratio('plan', 'ort_enable_extended'):>8.2f}x "
              f"{r.ratio('plan', 'ort_disable_all'):>8.2f}x "
              f"{vs_unfused:>8.2f}x {r.arena_peak_bytes / 2**20:>7.2f}MB {r.activation_bytes / 2**20:>7.2f}MB "
              f"{arena:>6.0%} {r.segments['generated']:>4}/{r.segments['library']:<3} {'yes':>6} "
              f"{time.perf_counter() - start:>5.0f}s", flush=True)
        ort_target, unfused_target = target(name)
        if ort_target is not None and vs_ort > ort_target:
            missed.append(f"{name}: plan {rounds} ORT ENABLE_ALL per round (target <= {ort_target}x)")
        if unfused_target is not None and vs_unfused > unfused_target:
            missed.append(f"{name}: plan {vs_unfused:.2f}x unfused (target <= {unfused_target}x)")
        if arena > ARENA_TARGET:
            missed.append(f"{name}: arena {arena:.0%} of activations (target <= {ARENA_TARGET:.0%})")
    print("targets not met:" if missed else "every target met")
    for line in missed:
        print(f"  {line}")


if __name__ == "__main__":
    main()
