"""A plan's program with each segment's team kernels in one OpenMP region against the same
program with a region per kernel (figures printed, never asserted).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_regions.py --models llama-decode,bert-small,llama-prefill --threads 2

Each model's cpsat plan for `host`, priced for --threads and run with as many; both programs
checked equal to ONNX Runtime, then timed in turn each round (`run._timed`), judged round by
round (`timing.paired`). Also printed: the kernels and the regions the shared program opens.
"""

from __future__ import annotations

import argparse
import importlib

from benchutil import machine, run_at

from fusesearch.api import plan as make_plan
from fusesearch.backends.timing import paired
from fusesearch.ir.precision import prepared_tolerance
from fusesearch.pipeline import prepare

RUN = importlib.import_module("fusesearch.run")  # the module (the package's `run` is the API function)


def bench(name: str, threads: int, repeat: int, warmup: int, time_limit: float) -> str:
    prep = prepare(f"zoo:{name}")
    plan = make_plan(f"zoo:{name}", device="host", strategy="cpsat", prepared=prep, time_limit_s=time_limit,
                     threads=threads)
    canonical, weights, feeds, reference = RUN._reference(prep, {"plan": plan}, 0, None)
    steps = RUN.plan_steps(prep.graph, plan)
    built = {}
    for label, shared in (("one region", True), ("region each", False)):
        built[label], _, _ = RUN.checked(label, lambda reuse, shared=shared: RUN.Program(
            prep.graph, canonical, steps, weights, threads, reuse=reuse, shared=shared),
            canonical, feeds, reference, prepared_tolerance(prep), False)
    runs = {label: run_at(p, threads, feeds) for label, p in built.items()}
    try:
        for once in runs.values():
            for _ in range(warmup):
                once()
        t = RUN._timed(runs, 0, repeat)
    finally:
        RUN.restore_threads()
    pair = paired(t["one region"], t["region each"])
    kernels = [s.kernel for s in steps if s.kernel is not None]
    teams = RUN._teams(kernels)
    return (f"{name:<14} {t['one region'].median_s * 1e3:9.3f} {t['region each'].median_s * 1e3:9.3f}   "
            f"{pair.median:.3f}x ({pair.p20:.3f}-{pair.p80:.3f}) {pair.compared('faster', 'slower'):<20} "
            f"{len(kernels):4d} {len(teams):4d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-decode,bert-small,llama-prefill,rnn-control")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args()
    print(f"{machine()}; plans priced for and run with {args.threads} thread(s), {args.repeat} rounds")
    print("model          one region, ms  region each, ms   one / each per round   verdict  kernels regions")
    for name in args.models.split(","):
        print(bench(name, args.threads, args.repeat, args.warmup, args.time_limit), flush=True)


if __name__ == "__main__":
    main()
