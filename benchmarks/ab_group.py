"""One generated group against variants of its own C source, timed interleaved (figures printed,
never asserted): how docs/benchmarks.md's "measured and not kept" and "what a part costs" figures are made.

Problem: a fused kernel's time is the sum of parts no profiler on a shared 2-core VM separates
well (the product, a prologue, an erf epilogue, a Softmax pass), and a tried code change is only
worth keeping if it beats the kernel it would replace on the same machine minutes apart.
Approach: a variant file (`benchmarks/variants/*.py`) names a zoo model, a group of it by its
nodes' names (NODES: the group a one-thread cpsat plan for the host takes, lowered as the host
plan lowers it, `packed`, or with LAYOUT = "nchwc" its blocked form, inputs and outputs in
channel blocks; named rather than planned, because the host's plan moves with its
measured figures and thread count; or GROUPS, a list of (model, nodes) pairs, each run in turn
against the same variants), and variants, each a list of (regular expression,
replacement) edits of the group's C texts (`texts`: its generated source, the shared C runtime's,
its units', each edited wherever a pattern matches; an edited runtime is linked as a unit of the
variant, ahead of the shared one); every edit must match one of them (a generator change that
moved the text fails loudly, never a silent no-op). CONSTANTS names variants generated afresh
with constants of `fusesearch.schedule` set otherwise (each must exist there; a schedule choice
that no regular expression can edit, such as a work split whose sizes run through the code). The
base and each variant are compiled, run once, checked against ONNX Runtime's values of the
group's outputs (the variants named in BOUNDS compute something else on purpose — a part taken
out — so their error is printed, not checked), then timed in ROUNDS interleaved rounds of
`measure_interleaved`; each round's medians are printed and, per variant, the median over rounds
of its time over the base's (below 1: the variant is faster). With `--flush MIB` a buffer of that
many MiB is summed before every sample, so each run finds its weights and inputs evicted from the
caches (256: from memory), as a kernel inside a whole program does after the rest of the model
and ONNX Runtime ran (`bench_program.py`), not in the cache as when it runs many times in a row.

With `--program` (CONSTANTS variants only) the group is timed inside the model's whole program
instead, one program per variant, the order rotated each round (`run_program`).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ab_group.py benchmarks/variants/gelu_epilogue.py
        [--rounds 7] [--budget 0.3] [--flush MIB] [--program] [--check: only that every edit still applies]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from costmodels.devices import host_cpu
from fusesearch import schedule
from fusesearch.backends import cpu
from fusesearch.backends.codegen import generate
from fusesearch.backends.codegen.c_runtime import C_RUNTIME
from fusesearch.backends.timing import measure_interleaved
from fusesearch.groups import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.layout import from_blocked, to_blocked
from fusesearch.lowering import Kernel, nchwc_choices, try_lower
from fusesearch.measure import max_rel_err
from fusesearch.pipeline import prepare
from fusesearch.schedule import TILE_EPILOGUE_LANES, CpuTarget
from fusesearch.verify import all_values, random_feeds

CHECK = 1e-4  # a variant that is not a bound must match ONNX Runtime as the base does (max_rel_err)


class VariantError(Exception):
    """A variant file that does not fit the generator's output (one clear line)."""


def load_variants(path: Path) -> dict:
    spec: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), spec)
    keys = () if "GROUPS" in spec else ("MODEL", "NODES")
    for key in keys:
        if key not in spec:
            raise VariantError(f"{path}: no {key} (a variant file sets MODEL and NODES, or GROUPS, VARIANTS or "
                               "CONSTANTS, and optionally BOUNDS)")
    if "VARIANTS" not in spec and "CONSTANTS" not in spec:
        raise VariantError(f"{path}: no VARIANTS or CONSTANTS (the variants to time against the group)")
    unknown = [name for consts in spec.get("CONSTANTS", {}).values() for name in consts if not hasattr(schedule, name)]
    if unknown:
        raise VariantError(f"{path}: fusesearch.schedule has no constant {unknown[0]} (CONSTANTS sets its constants)")
    return spec


@contextmanager
def constants(values: dict):
    """`fusesearch.schedule`'s constants set to `values` for the block, restored after."""
    before = {name: getattr(schedule, name) for name in values}
    try:
        for name, value in values.items():
            setattr(schedule, name, value)
        yield
    finally:
        for name, value in before.items():
            setattr(schedule, name, value)


def groups(spec: dict) -> list:
    """The (model, nodes) pairs a variant file names: its GROUPS, or its one MODEL and NODES."""
    return list(spec["GROUPS"]) if "GROUPS" in spec else [(spec["MODEL"], spec["NODES"])]


def group_kernel(model: str, nodes, layout: str = "nchw", lanes: int | None = None):
    """(prepared model, the group of these nodes' Kernel as the host lowers it, its generated kernel):
    its default choice for a CPU with AVX-512's vectors, whose source's tile epilogue sits under
    `#ifdef FS_TILE_EPI`, so that it runs as this machine's compiler allows; `layout` "nchwc":
    its blocked form in this machine's channel blocks, or those of `lanes` float lanes
    (`lowering.nchwc_choices`, its first: the form for all the machine's usable CPUs, as many as
    OMP_NUM_THREADS allows)."""
    prep = prepare(f"zoo:{model}")
    ids = {node.name: node.id for node in prep.graph.nodes}
    missing = [name for name in nodes if name not in ids]
    if missing:
        raise VariantError(f"{model} has no node {missing[0]} (NODES or GROUPS names the group's nodes)")
    group = FusionGroup(frozenset(ids[name] for name in nodes))
    if layout == "nchwc":
        host = host_cpu()
        lanes = lanes or host.warp_size
        forms = nchwc_choices(prep.graph, group, CpuTarget(lanes=lanes, threads=host.sm_count))
        if not forms:
            raise VariantError(f"the group of NODES has no blocked form at {lanes} float lanes")
        return prep, forms[0], generate(prep.graph, forms[0], name="ab_group")
    kernel = try_lower(prep.graph, group, host=CpuTarget(lanes=TILE_EPILOGUE_LANES))
    if not isinstance(kernel, Kernel):
        raise VariantError(f"the group of NODES is not one kernel: {kernel.reason}")
    return prep, kernel, generate(prep.graph, kernel, name="ab_group")


def texts(kernel) -> tuple[str, ...]:
    """The C a generated kernel runs: its source, the shared runtime's, then its units'."""
    return (kernel.c_source, C_RUNTIME, *kernel.c_units)


def edited(sources: tuple[str, ...], edits, label: str) -> tuple[str, ...]:
    """`sources` with every (pattern, replacement) edit applied wherever it matches; each must
    match in one of them at least."""
    for pattern, replacement in edits:
        done = [re.subn(pattern, replacement, source) for source in sources]
        if not any(count for _, count in done):
            raise VariantError(f"variant '{label}': the pattern {pattern!r} is not in the group's source "
                               "(the generator changed: update the variant file)")
        sources = tuple(source for source, _ in done)
    return sources


def variant(kernel, sources: tuple[str, ...]):
    """The kernel running `sources` (edited `texts`): its source, and its units after the runtime
    where that was edited (linked ahead of the shared one: `cpu.libraries`)."""
    source, runtime, *units = sources
    return kernel.with_c_source(source, ((runtime,) if runtime != C_RUNTIME else ()) + tuple(units))


def run_group(spec: dict, model: str, nodes, args) -> None:
    """One group against the variants: checked against ONNX Runtime, then timed interleaved."""
    layout = spec.get("LAYOUT", "nchw")
    prep, kernel, base = group_kernel(model, nodes, layout)
    kernels = {label: variant(base, edited(texts(base), edits, label)) for label, edits in spec.get("VARIANTS", {}).items()}
    for label, values in spec.get("CONSTANTS", {}).items():
        with constants(values):
            kernels[label] = group_kernel(model, nodes, layout)[2]
    ops = "+".join(prep.graph.nodes[i].op_type for i in kernel.nodes)
    if args.check:
        print(f"{model} {ops}: the {len(kernels)} variants apply")
        return
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    inputs = {a.tensor: to_blocked(values[a.tensor], a.layout) for a in base.inputs}
    labels, runs = ["base"], [cpu.runner(base, inputs)]
    for label, generated in kernels.items():
        labels.append(label)
        runs.append(cpu.runner(generated, inputs))
    bounds = set(spec.get("BOUNDS", ()))
    print(f"{model} {ops}: {len(labels) - 1} variants, {args.rounds} rounds"
          + (f", a {args.flush} MiB buffer summed before every sample" if args.flush > 0 else ""))
    for label, run in zip(labels, runs, strict=True):
        run()
        outs = run.buffers[len(base.inputs):]
        err = max_rel_err({a.tensor: from_blocked(x.reshape(a.shape), a.layout, values[a.tensor].shape[1])
                           if a.layout.blocked else x for a, x in zip(base.outputs, outs, strict=True)}, values)
        note = " (a bound: computes something else)" if label in bounds else ""
        print(f"  {label}: error against ONNX Runtime {err:.1e}{note}")
        if label not in bounds and err > CHECK:
            sys.exit(f"variant '{label}' is wrong (error {err:.1e} > {CHECK}); list it in BOUNDS if that is meant")
    buffer = np.ones(args.flush << 18, np.float32) if args.flush > 0 else None
    flush = (lambda: float(buffer.sum())) if buffer is not None else None
    rounds = []
    for r in range(args.rounds):
        times = [t.median_s * 1e6 for t in measure_interleaved(runs, budget_s=args.budget, rounds=5, before_each=flush)]
        rounds.append(times)
        print(f"  round {r + 1}: " + ", ".join(f"{label} {t:.1f} us" for label, t in zip(labels, times, strict=True)))
    for i, label in enumerate(labels[1:], 1):
        ratios = [t[i] / t[0] for t in rounds]
        print(f"  {label}: {statistics.median(ratios):.3f}x the base's time (median over rounds; "
              f"rounds {min(ratios):.3f}-{max(ratios):.3f}); base median {statistics.median(t[0] for t in rounds):.1f} us")


def run_program(spec: dict, model: str, nodes, args) -> None:
    """`--program`: the model's whole cpsat plan for this host (at OMP_NUM_THREADS's threads) built
    as one program per CONSTANTS variant (every kernel generated under them), each checked against
    ONNX Runtime, then run once a round in an order rotated each round (a program run first in
    every round after ONNX Runtime's memory traffic, or after its own twin, would carry that
    place's bias); per variant the named group's time inside the program (its C clock: where its
    weights come from memory as the model runs) and the program's wall time, medians, and each
    over the base's in the same round (median, p20-p80)."""
    from fusesearch.api import plan as make_plan
    from fusesearch.run import Program, _reference, plan_steps

    if spec.get("VARIANTS"):
        raise VariantError("--program times CONSTANTS variants only (a whole program is generated under each)")
    prep = prepare(f"zoo:{model}")
    threads = host_cpu().sm_count
    plan = make_plan(f"zoo:{model}", device="host", strategy="cpsat", prepared=prep, threads=threads)
    ids = {node.name: node.id for node in prep.graph.nodes}
    if any(name not in ids for name in nodes):
        raise VariantError(f"{model} has no node {next(n for n in nodes if n not in ids)} (NODES or GROUPS names the group's nodes)")
    group = next((g.id for g in plan.groups if ids[nodes[0]] in g.nodes), None)
    canonical, weights, feeds, values = _reference(prep, {"base": plan}, 0, None)
    programs = {}
    for label, consts in {"base": {}, **spec.get("CONSTANTS", {})}.items():
        with constants(consts):
            programs[label] = Program(prep.graph, canonical, plan_steps(prep.graph, plan), weights, threads, profile=True)
        err = max_rel_err(programs[label](feeds), values)
        print(f"  {label}: the program's error against ONNX Runtime {err:.1e}")
        if err > CHECK:
            sys.exit(f"variant '{label}' is wrong (error {err:.1e} > {CHECK})")
    labels = list(programs)
    for program in programs.values():
        program.run()
        program.kernel_seconds(reset=True)
    wall: dict[str, list[float]] = {label: [] for label in labels}
    inside: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(args.rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            start = time.perf_counter()
            programs[label].run()
            wall[label].append(time.perf_counter() - start)
            inside[label].append(programs[label].kernel_seconds(reset=True).get(group, 0.0))
    print(f"{model}, the group of {nodes[0]} (g{group}) in its {threads}-thread program, {args.rounds} rounds, "
          "the order rotated each round:")
    def spread(xs: list[float]) -> str:
        return f"{np.percentile(xs, 50):.3f}x (p20-p80 {np.percentile(xs, 20):.3f}-{np.percentile(xs, 80):.3f})"

    for label in labels:
        mine = [a / b for a, b in zip(inside[label], inside["base"], strict=True)]
        ratios = [a / b for a, b in zip(wall[label], wall["base"], strict=True)]
        print(f"  {label}: group {statistics.median(inside[label]) * 1e6:.1f} us inside, per round {spread(mine)} "
              f"the base's; program {statistics.median(wall[label]) * 1e3:.3f} ms, per round {spread(ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", type=Path, help="a variant file (benchmarks/variants/*.py)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (each printed)")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per round over all runs")
    parser.add_argument("--flush", type=int, default=0, metavar="MIB",
                        help="sum a buffer of MIB MiB before every sample: the group's data evicted from the caches")
    parser.add_argument("--check", action="store_true", help="only check that every edit still applies")
    parser.add_argument("--program", action="store_true",
                        help="the group inside the model's whole program, one program per CONSTANTS variant")
    args = parser.parse_args()
    try:
        spec = load_variants(args.variants)
        for model, nodes in groups(spec):
            (run_program if args.program else run_group)(spec, model, nodes, args)
    except VariantError as exc:  # one line, exit code 2: the file does not fit this generator
        print(f"{args.variants}: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
