"""NCHWc chains beside the two blocked kernels they replace (figures printed, never asserted).

A chain (`schedule.anchor_chain`: a 1x1 conv, its activation and the depthwise conv after it, one
kernel, `codegen.cpu_conv_chain`) saves its middle tensor's trip to memory and back. For each
chain the exact search may choose in a zoo model (`candidates.enumerate.blocked_only_candidates`
on this machine's host figures, the activation after the depthwise conv included), timed
interleaved (`measure_interleaved`) on the threads OMP_NUM_THREADS gives (default 1):
  - two: the expansion group (1x1 conv + activation) and then the depthwise group, each its
    blocked form (`lowering.nchwc_choices`), the second reading the buffer the first wrote, as in
    a program;
  - chain: the chain's one kernel on the same input.
Per chain the medians of the rounds' medians with their p20-p80 spread (ms), the per-round ratio
chain/two (median and p20-p80: '~' where that range holds 1) and the model's predictions of both; the load average before
and after.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_chains.py [--models mobilenetv2] [--rounds 7]
        [--budget 0.5]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from benchutil import spread  # noqa: E402

from fusesearch.api import search_prepared  # noqa: E402
from fusesearch.backends import cpu  # noqa: E402
from fusesearch.backends.codegen import NP_DTYPES, generate  # noqa: E402
from fusesearch.backends.timing import measure_interleaved  # noqa: E402
from fusesearch.candidates.enumerate import blocked_only_candidates  # noqa: E402
from fusesearch.ir.canonicalize import to_proto  # noqa: E402
from fusesearch.layout import Layout, to_blocked  # noqa: E402
from fusesearch.pipeline import prepare  # noqa: E402
from fusesearch.schedule import anchor_chain  # noqa: E402
from fusesearch.search.problem import SearchConfig  # noqa: E402
from fusesearch.verify import all_values, random_feeds  # noqa: E402


def _feeds(gk, values: dict) -> dict:
    return {a.tensor: to_blocked(values[a.tensor], Layout(a.shape[-1])) if len(a.shape) == 5 else values[a.tensor]
            for a in gk.inputs}


def _runner(gk, feeds: dict, buffers: dict):
    """`cpu.runner`'s call of `gk`, its arrays taken from `buffers` by tensor where there (a
    tensor an earlier kernel writes), else made (and kept there); filters packed once."""
    lib = cpu.compile_kernel(gk)
    for a in (*gk.inputs, *gk.outputs):
        if a.tensor not in buffers:
            buffers[a.tensor] = cpu.aligned_array(a.shape, NP_DTYPES[a.dtype], feeds.get(a.tensor))
    packed = [cpu.aligned_array(p.arg.shape, np.float32) for p in gk.packed]
    arrays = [buffers[a.tensor] for a in (*gk.inputs, *gk.outputs)] + packed
    pointers = [x.ctypes.data_as(ctypes.c_void_p) for x in arrays]
    if packed:
        pack = getattr(lib, f"{gk.name}_pack")
        pack.argtypes = [ctypes.c_void_p] * (len(gk.inputs) + len(packed))
        pack(*pointers[:len(gk.inputs)], *pointers[len(gk.inputs) + len(gk.outputs):])
    fn = getattr(lib, gk.name)
    fn.restype, fn.argtypes = None, [ctypes.c_void_p] * len(pointers)

    def go() -> None:
        fn(*pointers)
    go.arrays = arrays
    return go


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=10)
    return statistics.median(xs), q[1], q[7]


def bench_model(name: str, args) -> None:
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    prep = prepare(f"zoo:{name}")
    _, legality, prep, _ = search_prepared(prep, "host", "none", SearchConfig(), threads=threads)
    graph = legality.graph
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    found = blocked_only_candidates(legality)
    chains = [g for g in found if len(g) == max(len(h) for h in found if min(h) == min(g))]
    print(f"{name}: {len(chains)} chains, {threads} thread(s), {args.rounds} interleaved rounds; ms, median (p20-p80)")
    print(f"{'input -> output':>34} {'two kernels':>24} {'chain':>24} {'chain/two per round':>22} {'predicted two':>14} {'chain':>8}")
    for group in chains:
        anchors = anchor_chain(graph, group).anchors
        # each anchor's own group: it and the ops after it up to the next anchor
        owner = {i: max((a for a in anchors if a.id == i or graph.reaches(a.id, i)), key=lambda a: a.id).id
                 for i in group}
        parts = [legality.blocked(frozenset(i for i in group if owner[i] == a.id)) for a in anchors]
        chain = legality.blocked(group)
        kernels = [generate(graph, v.kernel) for v in parts]
        buffers: dict = {}  # by tensor: each kernel reads the buffer the one before writes
        runs = [_runner(gk, _feeds(gk, values), buffers) for gk in kernels]
        gk = generate(graph, chain.kernel)
        run_c = _runner(gk, _feeds(gk, values), {})

        rounds = [measure_interleaved([lambda runs=runs: [r() for r in runs], run_c], budget_s=args.budget / args.rounds,
                                      rounds=1) for _ in range(args.rounds)]
        two_t = [statistics.median(r[0].samples_s) for r in rounds]
        chain_t = [statistics.median(r[1].samples_s) for r in rounds]
        med, lo, hi = _quantiles([c / t for c, t in zip(chain_t, two_t, strict=True)])
        label = f"{graph.tensors[anchors[0].inputs[0]].shape[1:]} -> {graph.tensors[anchors[-1].outputs[0]].shape[1:]}"
        print(f"{label:>34} {spread(*_quantiles(two_t)):>24} {spread(*_quantiles(chain_t)):>24} "
              f"{('~' if lo <= 1 <= hi else '') + f'{med:.2f}x ({lo:.2f}-{hi:.2f})':>22} "
              f"{sum(p.time_s for p in parts) * 1e3:14.3f} {chain.time_s * 1e3:8.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mobilenetv2")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget", type=float, default=0.5)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for name in args.models.split(","):
        bench_model(name.strip(), args)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
