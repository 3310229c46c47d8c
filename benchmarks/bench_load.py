"""Benchmarks of the foundation (figures printed, not asserted).

1. load + canonicalize + build the Graph of zoo bert-base (12 layers, seq 128): target < 10 s.
2. reachability over a synthetic 10,000-node graph (build the bitsets + 100k `reaches` queries +
   1k convexity checks): target < 1 s.
3. `host_cpu()` on a machine seen for the first time (an empty cache folder: every probe runs):
   target < 3 s.
Each is run several times; the median and the spread are printed.

    .venv/bin/python benchmarks/bench_load.py [--repeats N] [--model zoo:bert-base]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from fusesearch.ir.graph import Graph, Node, TensorInfo
from fusesearch.ir.op_kind import OpKind
from fusesearch.pipeline import prepare


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def report(label: str, times: list[float], target_s: float) -> None:
    med = statistics.median(times)
    print(f"{label}: median {med:.3f} s (min {min(times):.3f}, max {max(times):.3f}, n={len(times)}) "
          f"target < {target_s:g} s: {'ok' if med < target_s else 'MISSED'}")


def synthetic_graph(n: int, seed: int = 0) -> Graph:
    """A layered DAG like a deep network: each node reads its predecessor and, sometimes, a node
    up to 8 back (residuals)."""
    rng = random.Random(seed)
    nodes = []
    for i in range(n):
        inputs = [f"t{i - 1}" if i else "x"]
        if i > 8 and rng.random() < 0.3:
            inputs.append(f"t{i - rng.randint(2, 8)}")
        nodes.append(Node(i, f"n{i}", "Add", "", OpKind.BROADCAST, tuple(inputs), (f"t{i}",), {}))
    tensors = {f"t{i}": TensorInfo(f"t{i}", (64,), "float32") for i in range(n)}
    return Graph.build("synthetic", nodes, tensors, ["x"], [f"t{n - 1}"])


def reachability(n: int) -> None:
    g = synthetic_graph(n)
    rng = random.Random(1)
    hits = sum(g.reaches(rng.randrange(n), rng.randrange(n)) for _ in range(100_000))
    convex = sum(g.is_convex(range(s, s + rng.randint(1, 16))) for s in rng.sample(range(n - 16), 1000))
    assert hits > 0 and convex > 0


def host_cpu_anew() -> None:
    """host_cpu() with every probe run: no cached figures, in a fresh cache folder."""
    from costmodels import host_cpu, probes

    with tempfile.TemporaryDirectory() as folder:
        os.environ["FUSESEARCH_CACHE"] = folder
        for cached in (host_cpu, probes.measure_copy_bandwidth, probes.measure_fma_peak,
                       probes.measure_launch_overhead):
            cached.cache_clear()
        host_cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="zoo:bert-base")
    args = parser.parse_args()
    prep = prepare(args.model)
    print(f"{args.model}: {prep.loaded.nodes} nodes → {len(prep.graph)} canonical; passes {prep.passes}")
    report(f"load+canonicalize+Graph {args.model}", timed(lambda: prepare(args.model), args.repeats), 10.0)
    report("reachability, 10,000-node graph (build + 100k reaches + 1k convexity)",
           timed(lambda: reachability(10_000), args.repeats), 1.0)
    before = os.environ.get("FUSESEARCH_CACHE")
    try:
        report("host_cpu() on a new machine (every probe)", timed(host_cpu_anew, args.repeats), 3.0)
    finally:
        if before is None:
            os.environ.pop("FUSESEARCH_CACHE", None)
        else:
            os.environ["FUSESEARCH_CACHE"] = before


if __name__ == "__main__":
    main()
