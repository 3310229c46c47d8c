"""Two thread pools in one process: ONNX Runtime's time inside `run --threads N` against its time
alone, with each pool's spinning after its run left on and turned off (figures printed, not
asserted).

`run` times our OpenMP program and ONNX Runtime in turn in one process. A pool whose threads
spin after their work (libgomp: ~3 ms by default, GOMP_SPINCOUNT 300000; ONNX Runtime's
intra-op pool) takes the cores from the program timed next. Each mode runs in a fresh process
(libgomp reads its policy once, when it loads):

    spinning     libgomp's default wait (no OMP_WAIT_POLICY: ~3 ms of spinning) and ONNX Runtime
                 sessions without `session.force_spinning_stop`
    passive      OMP_WAIT_POLICY=PASSIVE (a thread sleeps as a region ends, so each region of the
                 program wakes its threads again) and every session stopping its spin when its Run
                 returns (`verify.NO_SPINNING_AFTER_RUN`)
    bounded      libgomp's threads spin about 0.3 ms (`probes.OPENMP_WAIT`, awake from one
                 kernel's region to the next, asleep soon after the program) and the sessions as
                 in passive: `run`'s settings on an idle machine (`probes.openmp_wait`)

In each, `run_plan` times the plan, the unfused program and ONNX Runtime interleaved (ONNX
Runtime's canonical-model ENABLE_ALL session is the figure compared), then the same session
alone, back to back, the OpenMP threads idle. Medians with p20-p80 over n runs.

    .venv/bin/python benchmarks/bench_spinning.py [--model mobilenetv2] [--threads 2] [--repeat 30]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODES = ("spinning", "passive", "bounded")


def one(model: str, threads: int, repeat: int, mode: str) -> dict:
    """The figures of one mode, in this process."""
    import time

    from costmodels.probes import OPENMP_PASSIVE, OPENMP_WAIT
    from fusesearch import verify
    from fusesearch.api import plan as make_plan
    from fusesearch.backends.timing import Timing
    from fusesearch.ir.canonicalize import to_proto
    from fusesearch.pipeline import prepare
    from fusesearch.run import run_plan
    from fusesearch.verify import random_feeds, session, session_feeds

    if mode == "spinning":  # libgomp's default wait (its count, set), sessions spinning after a Run
        os.environ["GOMP_SPINCOUNT"] = "300000"
        verify.NO_SPINNING_AFTER_RUN = {}
    else:  # set here, not left to the machine's idleness when libgomp loads (`probes.openmp_wait`)
        os.environ.update(OPENMP_PASSIVE if mode == "passive" else OPENMP_WAIT)
    prep = prepare(f"zoo:{model}")
    p = make_plan(f"zoo:{model}", device="host", strategy="greedy", prepared=prep, threads=threads)
    unfused = make_plan(f"zoo:{model}", device="host", strategy="none", prepared=prep, threads=threads)
    report = run_plan(prep, p, unfused, threads=threads, repeat=repeat, warmup=3)
    canonical = to_proto(prep.canonical)
    sess = session(canonical, threads=threads, optimize=True)
    names = [o.name for o in sess.get_outputs()]
    feeds = session_feeds(sess, random_feeds(canonical, 0, None))
    for _ in range(3):
        sess.run(names, feeds)
    alone = []
    for _ in range(repeat):
        start = time.perf_counter()
        sess.run(names, feeds)
        alone.append(time.perf_counter() - start)

    def stats(t: Timing) -> dict:
        return {"median_s": t.median_s, "p20_s": t.p20_s, "p80_s": t.p80_s, "n": t.n}

    return {"mode": mode, "inside_run": stats(report.timings["ort_enable_all_canonical"]),
            "alone": stats(Timing(tuple(alone), 3, "perf_counter")), "plan": stats(report.timings["plan"]),
            "load_1min": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mobilenetv2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in a child
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(one(args.model, args.threads, args.repeat, args.mode)))
        return
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    print(f"zoo:{args.model}, {args.threads} threads, {os.cpu_count()} CPUs, n = {args.repeat} runs each "
          "(median, p20-p80)")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    for mode in MODES:
        done = subprocess.run([sys.executable, __file__, "--model", args.model, "--threads", str(args.threads),
                               "--repeat", str(args.repeat), "--mode", mode], env=env,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"{mode}: failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        line = [f"{mode:<12}"]
        for key, label in (("inside_run", "ORT inside run"), ("alone", "ORT alone"), ("plan", "plan inside run")):
            t = r[key]
            line.append(f"{label} {ms(t['median_s'])} ({ms(t['p20_s'])}-{ms(t['p80_s'])})")
        print("   ".join(line) + f"   load {r['load_1min']:.1f}")


if __name__ == "__main__":
    main()
