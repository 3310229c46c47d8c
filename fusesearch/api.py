"""The Python API for notebooks: `fusesearch.plan`, `measure`, `run`, `compare`, `sweep`.

Problem: researchers script experiments; they want the CLI's pipeline as one call returning
values they can inspect (`to_pandas()`), not files.
Approach: each function is its command's steps with the command's defaults — prepare (load →
canonicalize → [half conversion] → Graph), resolve the device (name or profile.json), search
(`search_prepared`), then measure / run / compare — and the command line calls the same
functions, so a flag and its keyword mean one thing. `plans_for` is the start `measure` and `run`
share: the prepared model, the user's input values, the plan (or a plan.json's groups) and the
unfused graph.
Invariants: no files are written (but `sweep`'s results folder); errors are the package's
(`FusesearchError`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusesearch.errors import BadInput
from fusesearch.ir.shapes import ShapeBindings
from fusesearch.plans import ModelInfo, Plan
from fusesearch.search.problem import SearchConfig, check_decompose, check_layouts


def resolve_device(name_or_path: str, threads: int | None = None):
    """(label, DeviceSpec, RooflineParams, profile path or None); `threads`: the OpenMP threads
    `host` is described with (its figures are this machine's at that count: `costmodels.host_cpu`);
    BadInput for an unknown name or a list of several (one command, one device: `compare` takes
    lists)."""
    from costmodels import CostModelError, load_device
    from costmodels.profile import TILES_FILE
    from fusesearch.schedule import tuned_table_problem

    text = str(name_or_path)
    if "," in text and not Path(text).is_file():
        raise BadInput(f"--device {text}: give one device here (a name or a profile.json); to set several "
                       f"devices side by side run `fusesearch compare MODEL --device {text}`")
    try:
        spec, params = load_device(name_or_path, threads)
    except CostModelError as exc:
        raise BadInput(f"--device {name_or_path}: {exc}") from None
    is_profile = str(name_or_path).endswith(".json") or Path(str(name_or_path)).is_file()
    if problem := tuned_table_problem(spec.tuned_tiles):
        raise BadInput(f"--device {name_or_path}: {Path(str(name_or_path)).parent / TILES_FILE}: {problem}; "
                       "write it again with scripts/tune_tiles.py or remove it")
    return (spec.name, spec, params, str(name_or_path) if is_profile else None)


def for_device(prep, spec, params):
    """(prepared model, cost-model parameters) for one device: TF32 is used only where the user
    allows it (`--no-tf32` clears `Graph.allow_tf32`) and the device has TF32 tensor cores (sm_80
    and later; never on a CPU), and then for both the generated skeleton and the library's price."""
    if prep.graph.allow_tf32 and spec.tf32_flops_per_s <= 0:
        prep = dataclasses.replace(prep, graph=dataclasses.replace(prep.graph, allow_tf32=False))
    return prep, (params if prep.graph.allow_tf32 else params.with_updates(float32_uses_tf32=False))


def model_info(prep) -> ModelInfo:
    return ModelInfo(prep.loaded.name, prep.loaded.sha256, prep.loaded.nodes, len(prep.graph))


def bindings(input_shapes: Mapping[str, Iterable[int]] | None = None, dims: Mapping[str, int] | None = None):
    """`ShapeBindings` from {input: shape} and {dim: value} (the --input-shape / --dim flags)."""
    return ShapeBindings.parse([f"{k}={'x'.join(map(str, v))}" for k, v in (input_shapes or {}).items()],
                               [f"{k}={v}" for k, v in (dims or {}).items()])


def search_prepared(prep, device: str, strategy: str, config: SearchConfig, costs: str = "predicted",
                    threads: int = 1):
    """(plan, legality, prepared model for the device, tuner or None): the search every command
    runs, a CPU's plan priced (and its choices measured, `costs`) for `threads` OpenMP threads."""
    from costmodels import RooflineModel
    from fusesearch.autotune import tuned_search
    from fusesearch.backends.cpu import openmp_threads

    label, spec, params, profile = resolve_device(device, threads)
    prep, params = for_device(prep, spec, params)
    with openmp_threads(threads if spec.kind == "cpu" else 0):
        result, problem = tuned_search(prep, spec, RooflineModel(params), strategy, config, costs, profile,
                                       device_label=label, model_info=model_info(prep))
    return result, problem.legality, prep, problem.legality.measurer


def plan(model: str, device: str = "h100-sxm", strategy: str = "cpsat", *,
         input_shapes: Mapping[str, Iterable[int]] | None = None, dims: Mapping[str, int] | None = None,
         time_limit_s: float = 60.0, max_group_size: int = 16, seed: int = 0,
         workers: int | None = None, prepared=None, dtype: str = "float32", tf32: bool = True,
         lone_anchors: str = "priced", costs: str = "predicted", threads: int = 1,
         decompose: str = "auto", layouts: str = "auto") -> Plan:
    """`dtype`: float16 / bfloat16 plans the model converted to half (`ir.precision`); `tf32`:
    False plans float32 GEMMs and convs without TF32 (`--no-tf32`); `lone_anchors`: how a lone
    gemm/conv may run (`rules.LONE_ANCHORS`): "library" makes every one a library call (with
    strategy none: the unfused graph as ONNX Runtime runs it node by node, `measure --baseline
    library`'s reference), "generated" our kernel, "priced" whichever is cheaper; `costs`: what
    prices each group's choices (`autotune`): "predicted" (the cost model), "measured" (each timed
    on this machine: the CPU for host, CuPy for a GPU; kept in the timing database) or "hybrid"
    (the model's plan, then the choices of the groups each plan uses, searched again until the
    plan uses only measured groups); `threads`: the OpenMP threads a CPU plan is priced for
    (`--threads`, recorded in plan.json); `decompose`: whether cpsat cuts the graph into pieces
    (`search.problem.DECOMPOSE`: "auto" from a size on, "always", "never"); `layouts`: whether a CPU
    plan of a CNN may run groups in channel blocks (`search.problem.LAYOUTS`: "auto", "nchw")."""
    from fusesearch.autotune import check_costs
    from fusesearch.pipeline import prepare

    check_costs(costs)
    check_decompose(decompose)
    check_layouts(layouts, "layouts =")
    resolve_device(device, threads)  # a bad device before any loading
    prep = prepared or prepare(model, bindings(input_shapes, dims), dtype=dtype, tf32=tf32)
    config = SearchConfig(time_limit_s=time_limit_s, seed=seed, max_group_size=max_group_size,
                          lone_anchors=lone_anchors, decompose=decompose, layouts=layouts,
                          **({"workers": workers} if workers else {}))
    result, _, _, tuner = search_prepared(prep, device, strategy, config, costs, threads)
    return result  # a plan priced by measurements carries what measuring cost (`Plan.tuning`)


# -- measure and run: one start ----------------------------------------------------------------

@dataclass
class Planned:
    """What `measure` and `run` start from: the model prepared for the device, the user's input
    values (arrays), the plan and the unfused graph (strategy none's plan)."""

    prep: Any
    values: dict
    plan: Plan
    unfused: Plan


def plans_for(model: str, device: str, strategy: str, *, command: str, plan_file: str | Path | None = None,
              shape_bindings=None, value_flags: Sequence[str] = (), dtype: str = "float32", tf32: bool = True,
              time_limit_s: float = 60.0, seed: int = 0, lone_anchors: str = "priced", costs: str = "predicted",
              threads: int = 1, say: Callable[[str], None] | None = None, layouts: str = "auto") -> Planned:
    """Prepare MODEL, read the input values (`--input-value` flags), refuse a graph too large for
    memory, then plan it (or take `plan_file`'s groups) and the unfused graph: `measure_plans`."""
    from fusesearch.pipeline import prepare
    from fusesearch.verify import check_memory, parse_input_values

    config = SearchConfig(time_limit_s=time_limit_s, seed=seed, max_group_size=16, layouts=check_layouts(layouts))
    prep = prepare(model, shape_bindings or bindings(), dtype=dtype, tf32=tf32)
    values = parse_input_values(list(value_flags), prep.graph)
    check_memory(prep.graph, "give a smaller --dim or --input-shape", command)
    plan_, unfused, prep = measure_plans(prep, device, strategy, config, plan_file, lone_anchors, costs, threads, say)
    return Planned(prep, values, plan_, unfused)


def measure_plans(prep, device, strategy, config, plan_file=None, lone_anchors: str = "priced",
                  costs: str = "predicted", threads: int = 1, say: Callable[[str], None] | None = None):
    """(plan, unfused, prep): the unfused graph is strategy none's plan, its lone anchors as
    `lone_anchors` says (`measure --baseline`: library calls, or our kernels priced as themselves);
    the plan's choices (a --plan file's groups too) priced as `costs` says, the unfused graph's
    predicted, a CPU's for `threads` (a --plan file priced for another count: a warning). `say`:
    told what measuring the choices cost (with costs other than predicted)."""
    from fusesearch.plans import SolverInfo

    plan_, legality, prep, tuner = search_prepared(prep, device, strategy if plan_file is None else "none", config,
                                                   costs, threads)
    if tuner is not None and say is not None:
        say(tuner.stats.line())
    unfused = search_prepared(prep, device, "none", dataclasses.replace(config, lone_anchors=lone_anchors),
                              threads=threads)[0]
    warn_lanes(device, legality.device)
    if plan_file is not None:
        warn_threads(plan_file, threads)
        none = (search_prepared(prep, device, "none", config, threads=threads)[0] if lone_anchors != "priced"
                else unfused)
        from fusesearch.candidates.rules import Legality
        from fusesearch.costing import device_layout
        from fusesearch.export import plan_groups_from_json, plan_layouts_from_json
        from fusesearch.layout import NCHW

        # the file's groups are checked on this device; their size is the file's (no search limit)
        layout = device_layout(legality.device)
        legality = Legality(prep.graph, legality.device, legality.model, legality.capabilities,
                            max_group_size=len(prep.graph), measurer=legality.measurer, layout=layout)
        groups = [frozenset(g) for g in plan_groups_from_json(plan_file, prep.graph, legality)]
        layouts, blocked = plan_layouts_from_json(plan_file, prep.graph, layout)
        legality.layout = layout if blocked else NCHW  # the file's laid-out groups as it chose them
        priced = sum(((legality.blocked(g) if g in blocked else None) or legality.check(g)).time_s for g in groups)
        plan_ = Plan.build(legality, groups, strategy="file", device=resolve_device(device, threads)[0],
                           profile=None, solver=SolverInfo("FILE", priced, None),
                           model=model_info(prep), unfused_time_s=none.time_s, lower_bound_s=none.lower_bound_s,
                           priced=none.priced, blocked=blocked, layouts=layouts)
    return plan_, unfused, prep


def warn_threads(plan_file: str | Path, threads: int) -> None:
    """One warning when plan.json records a CPU plan priced for another thread count."""
    import logging

    try:
        priced = json.loads(Path(plan_file).read_text()).get("device", {}).get("threads")
    except (OSError, ValueError, AttributeError):
        return  # the file's own errors are reported where its groups are read
    if isinstance(priced, int) and priced != threads:
        logging.getLogger("fusesearch").warning(
            f"{plan_file} was priced for {priced} thread{'s' if priced != 1 else ''}; it runs with --threads "
            f"{threads}: its choices may not be the best at this count (plan again with --threads {threads})")


def warn_lanes(device: str, spec) -> None:
    """One warning when a CPU device (a profile calibrated on another machine) has other float32
    lanes than this machine, whose C backend runs the plan: its channel blocks are that CPU's
    (16 floats on an AVX2 machine run as pairs of vectors: a yolo-neck plan 20x slower), so the
    figures are neither that CPU's nor the best here."""
    import logging

    from costmodels.devices import host_lanes

    if spec.kind != "cpu":
        return
    here = host_lanes()  # /proc/cpuinfo read only for a CPU device
    if spec.warp_size == here:
        return
    logging.getLogger("fusesearch").warning(
        f"--device {device}: a CPU with {spec.warp_size} float32 lanes, this machine has {here}: the plan's "
        "kernels run here in that CPU's vectors and channel blocks, so these figures are neither that CPU's nor "
        "the best here (plan with --device host, or a profile calibrated on this machine)")


def value_flags(input_values: Mapping[str, Any] | None) -> list[str]:
    """{input: value} (a number or an array) as `--input-value NAME=V` flags."""
    import numpy as np

    return [f"{k}={json.dumps(np.asarray(v).ravel().tolist() if np.ndim(v) else np.asarray(v).item())}"
            for k, v in (input_values or {}).items()]


@dataclass
class Measured:
    """`measure`'s result: every kernel's measurement (`report`, a `measure.MeasureReport`), the
    plan measured, and with `end_to_end` the run's figures (`run.RunReport`)."""

    report: Any
    plan: Plan
    end_to_end: Any = None

    def to_dict(self) -> dict:
        """`measure --json`'s document."""
        return {**self.report.to_dict(), **({"end_to_end": self.end_to_end.to_dict()} if self.end_to_end else {})}

    def to_pandas(self):
        """A row per kernel (`measure -o`'s table); with end_to_end the run's figures on every row."""
        rows = self.report.to_pandas()
        return rows if self.end_to_end is None else rows.assign(**self.end_to_end.columns())


def measure(model: str, backend: str = "cpu", *, plan_file: str | Path | None = None, device: str | None = None,
            strategy: str = "cpsat", input_shapes: Mapping[str, Iterable[int]] | None = None,
            dims: Mapping[str, int] | None = None, time_limit_s: float = 60.0, budget_s: float = 0.2, seed: int = 0,
            cache: bool = True, ptxas: bool | None = None, flush_l2: bool = False, baseline: str = "library",
            input_values: Mapping[str, Any] | None = None, end_to_end: bool = False, dtype: str = "float32",
            tf32: bool = True, costs: str = "predicted", threads: int = 1, shape_bindings=None,
            value_strings: Sequence[str] = (), progress: Callable[[int, int], None] | None = None,
            say: Callable[[str], None] | None = None) -> Measured:
    """`fusesearch measure`: every kernel of the plan (planned now, or `plan_file`'s) and of the
    unfused graph timed on `backend` on real data, a CPU's at `threads` OpenMP threads;
    `progress(done, total)` after each kernel."""
    runs_on = check_measure(backend, baseline, end_to_end, costs)
    device = backend_device(device, runs_on, threads)
    p = plans_for(model, device, strategy, command="measure", plan_file=plan_file,
                  shape_bindings=shape_bindings or bindings(input_shapes, dims),
                  value_flags=[*value_strings, *value_flags(input_values)], dtype=dtype, tf32=tf32,
                  time_limit_s=time_limit_s, seed=seed, lone_anchors=baseline, costs=costs, threads=threads, say=say)
    return measure_planned(p, runs_on, device, budget_s=budget_s, seed=seed, cache=cache, ptxas=ptxas,
                           flush_l2=flush_l2, baseline=baseline, end_to_end=end_to_end, threads=threads,
                           progress=progress)


def check_measure(backend: str, baseline: str, end_to_end: bool, costs: str):
    """The backend of a measure, its flags checked before any work."""
    from fusesearch.autotune import check_costs
    from fusesearch.backends.registry import get_backend
    from fusesearch.measure import BASELINES

    runs_on = get_backend(backend)
    check_costs(costs)
    if baseline not in BASELINES:
        raise BadInput(f"--baseline {baseline}: choose one of {', '.join(BASELINES)}")
    if end_to_end and not runs_on.end_to_end:
        raise BadInput("--end-to-end: whole programs run on cpu only so far; drop it or use --backend cpu")
    return runs_on


def measure_planned(p: Planned, runs_on, device: str, *, budget_s: float = 0.2, seed: int = 0, cache: bool = True,
                    ptxas: bool | None = None, flush_l2: bool = False, baseline: str = "library",
                    end_to_end: bool = False, threads: int = 1,
                    progress: Callable[[int, int], None] | None = None) -> Measured:
    """`measure` of plans made (`plans_for`): every kernel timed (a CPU's at `threads`), and with
    `end_to_end` the run."""
    from fusesearch.backends.cpu import openmp_threads
    from fusesearch.backends.timing import TimingCache
    from fusesearch.measure import measure_plan

    total, done = len(p.plan.groups) + len(p.unfused.groups), [0]

    def advance(_label) -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total)

    with openmp_threads(0 if runs_on.cuda else threads):
        report = measure_plan(p.prep, p.plan, p.unfused, runs_on, budget_s=budget_s, seed=seed, progress=advance,
                              cache=TimingCache() if cache else None,
                              ptxas_arch=_ptxas_arch(device) if (ptxas if ptxas is not None else runs_on.cuda)
                              else None, flush_l2=flush_l2, baseline=baseline, input_values=p.values)
    whole = _end_to_end(p, seed, threads) if end_to_end else None
    return Measured(report, p.plan, whole)


def _ptxas_arch(device: str) -> str:
    """The cost-model device's arch when it is a GPU (sm_80 / sm_90 compile here), else sm_90."""
    arch = resolve_device(device)[1].arch
    return arch if arch in ("sm_80", "sm_90") else "sm_90"


def _end_to_end(p: Planned, seed: int, threads: int):
    """`run`'s figures for measure --end-to-end, at `threads` (--threads)."""
    from fusesearch.run import run_plan

    report = run_plan(p.prep, p.plan, p.unfused, threads=threads, seed=seed, input_values=p.values)
    report.model = p.prep.loaded.name
    return report


@dataclass
class Ran:
    """`run`'s result: the timings and checks (`report`, a `run.RunReport`), the plan run and the
    prepared model and input values it ran on."""

    report: Any
    planned: Planned

    @property
    def plan(self) -> Plan:
        return self.planned.plan

    def to_dict(self) -> dict:
        """`run --json`'s document."""
        return self.report.to_dict()

    def to_pandas(self):
        """A row per program timed (`run -o`'s table)."""
        return self.report.to_pandas()


def plan_rtol(plan_: Plan) -> float:
    """The tolerance the plan's tensor-core kernels need (their operands keep fewer mantissa bits:
    `codegen.mma.TOLERANCE`), 0 without any; `run` takes the larger of it and the dtype's."""
    from fusesearch.backends.codegen.mma import TOLERANCE as TENSOR_CORE

    return max([0.0] + [TENSOR_CORE[g.kernel.schedule.skeleton] for g in plan_.groups
                        if g.kernel.schedule.skeleton in TENSOR_CORE])


def run_tolerance(p: Planned, rtol: float | None) -> float:
    """`run --rtol`, default the larger of the dtype's tolerance and the plan's tensor cores'."""
    from fusesearch.ir.precision import prepared_tolerance

    return max(prepared_tolerance(p.prep), plan_rtol(p.plan)) if rtol is None else rtol


def backend_device(device: str | None, backend, threads: int, *, program: bool = False) -> str:
    """The cost-model device (default: the backend's) of a plan timed on BACKEND: a profile must
    be of the device it measures (a host one calibrated at `threads`), and a whole program
    (`program`) on CUDA needs a GPU device (exit 2)."""
    from fusesearch.calibrate import check_profile_for_backend

    device = device or backend.default_device
    if backend.timed:
        check_profile_for_backend(device, backend, threads=threads)
    if program and backend.cuda and resolve_device(device)[1].kind != "gpu":
        raise BadInput(f"--device {device}: a plan for a CPU fuses GEMMs and convs as C only (the packed "
                       f"skeleton), and --backend {backend.name} runs CUDA; give a GPU device (e.g. --device h200)")
    return device


def run(model: str, *, plan_file: str | Path | None = None, strategy: str = "cpsat", device: str | None = None,
        backend: str = "cpu", input_shapes: Mapping[str, Iterable[int]] | None = None,
        dims: Mapping[str, int] | None = None, repeat: int = 20, warmup: int = 3, threads: int = 1,
        time_limit_s: float = 60.0, seed: int = 0, rtol: float | None = None, check_each: bool = False,
        input_values: Mapping[str, Any] | None = None, dtype: str = "float32", tf32: bool = True,
        costs: str = "predicted", baselines: Sequence[str] = (), shape_bindings=None,
        value_strings: Sequence[str] = (), progress: Callable[[str], None] | None = None,
        say: Callable[[str], None] | None = None) -> Ran:
    """`fusesearch run`: the plan and the unfused graph run end to end as programs on `backend`,
    checked equal to ONNX Runtime and timed beside it."""
    from fusesearch.backends.registry import get_backend

    get_backend(backend)  # one that times
    runs_on = check_run(backend, baselines, costs)
    device = backend_device(device, runs_on, threads, program=True)
    p = plans_for(model, device, strategy, command="run", plan_file=plan_file,
                  shape_bindings=shape_bindings or bindings(input_shapes, dims),
                  value_flags=[*value_strings, *value_flags(input_values)], dtype=dtype, tf32=tf32,
                  time_limit_s=time_limit_s, seed=seed, costs=costs, threads=threads, say=say)
    return run_planned(p, runs_on, threads=threads, repeat=repeat, warmup=warmup, seed=seed, rtol=rtol,
                       check_each=check_each, baselines=baselines, progress=progress)


def check_run(backend: str, baselines: Sequence[str], costs: str):
    """The backend of a run, its flags checked before any work; it may be one that only checks
    (emulate)."""
    from fusesearch.autotune import check_costs
    from fusesearch.backends.registry import get_backend
    from fusesearch.run import check_baselines

    check_baselines(baselines)
    runs_on = get_backend(backend, timing=False)
    check_costs(costs)
    runs_on.require(timing=False)
    return runs_on


def run_planned(p: Planned, runs_on, *, threads: int = 1, repeat: int = 20, warmup: int = 3, seed: int = 0,
                rtol: float | None = None, check_each: bool = False, baselines: Sequence[str] = (),
                progress: Callable[[str], None] | None = None) -> Ran:
    """`run` of plans made (`plans_for`) on a backend that times."""
    from fusesearch.run import run_plan

    report = run_plan(p.prep, p.plan, p.unfused, threads=threads, repeat=repeat, warmup=warmup, seed=seed,
                      rtol=run_tolerance(p, rtol), check_each=check_each, input_values=p.values, progress=progress,
                      backend=runs_on, baselines=tuple(baselines))
    report.model = p.prep.loaded.name
    return Ran(report, p)


# -- compare and sweep -------------------------------------------------------------------------

@dataclass
class Compared:
    """`compare`'s result: every (device, strategy)'s plan and the document `compare --json` prints."""

    plans: dict
    doc: dict

    def to_dict(self) -> dict:
        return self.doc

    def to_pandas(self):
        """A row per (device, strategy): kernels, predicted time, speedup, solver status."""
        import pandas as pd

        return pd.DataFrame(self.doc["results"])


def compare(model: str, devices: str | Sequence[str], strategies: str | Sequence[str] =
            ("none", "rules", "greedy", "cpsat"), *, input_shapes: Mapping[str, Iterable[int]] | None = None,
            dims: Mapping[str, int] | None = None, time_limit_s: float = 60.0, max_group_size: int = 16,
            seed: int = 0, workers: int | None = None, shape_bindings=None) -> Compared:
    """`fusesearch compare`: each strategy on each device, and where the devices' plans differ.
    `devices` / `strategies`: lists, or comma-separated as the flags take them."""
    from fusesearch.pipeline import prepare
    from fusesearch.search import STRATEGIES

    text = strategies if isinstance(strategies, str) else ",".join(strategies)
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STRATEGIES]
    if bad or not names:
        raise BadInput(f"--strategy {text}: unknown {', '.join(bad) or 'empty'}; choose from {', '.join(STRATEGIES)}")
    listed = devices if isinstance(devices, str) else ",".join(devices)
    devices = [d.strip() for d in listed.split(",") if d.strip()]
    if not devices:
        raise BadInput("--device: give at least one device name (see `fusesearch devices`)")
    config = SearchConfig(time_limit_s=time_limit_s, seed=seed, max_group_size=max_group_size,
                          **({"workers": workers} if workers else {}))
    prep = prepare(model, shape_bindings or bindings(input_shapes, dims))
    plans = {(d, s): search_prepared(prep, d, s, config)[0] for d in devices for s in names}
    return Compared(plans, compare_doc(prep, plans, devices, names))


def compare_doc(prep, plans, devices, names) -> dict:
    rows = [{"device": d, "strategy": s, "kernels": p.kernels, "time_s": p.time_s,
             "unfused_time_s": p.unfused_time_s, "lower_bound_s": p.lower_bound_s, "speedup": p.speedup,
             "status": p.solver.status, "wall_s": round(p.solver.wall_s, 3)} for (d, s), p in plans.items()]
    diffs = []
    for s in names:
        for i, a in enumerate(devices):
            for b in devices[i + 1:]:
                pa, pb = set(plans[(a, s)].partition()), set(plans[(b, s)].partition())
                label = lambda g: "+".join(prep.graph.nodes[v].name for v in sorted(g))  # noqa: E731
                diffs.append({"strategy": s, "devices": [a, b], "same": pa == pb,
                              "only_in_a": sorted(label(g) for g in pa - pb if len(g) > 1),
                              "only_in_b": sorted(label(g) for g in pb - pa if len(g) > 1)})
    return {"model": prep.loaded.name, "canonical_nodes": len(prep.graph), "results": rows,
            "differences": diffs}


@dataclass
class Swept:
    """`sweep`'s result: the sweep's name and threads, and the run's summary (`sweep.SweepSummary`)."""

    name: str
    threads: int
    summary: Any

    def to_dict(self) -> dict:
        """`sweep --json`'s document."""
        s = self.summary
        return {"sweep": self.name, "threads": self.threads, "out": str(s.out), "cells": s.cells, "skipped": s.skipped, "ran": s.ran, "failed": s.failed,
                "wall_s": round(s.wall_s, 1), "results": str(s.results)}

    def to_pandas(self):
        """A row per cell (`sweep.load_results`)."""
        from fusesearch.sweep import load_results

        return load_results(self.summary.out)


def sweep(config: str | Path, out: str | Path | None = None, *, workers: int | None = None,
          scheduler: str | None = None, force: bool = False, threads: int | None = None,
          progress: Callable[[int, int, dict | None], None] | None = None) -> Swept:
    """`fusesearch sweep`: every unfinished cell of the TOML grid CONFIG on Dask, results in `out`
    (default: beside CONFIG, named after it); `threads`: a CPU device's cells' (default: the
    config's). From a script, call it under `if __name__ == "__main__":` (local workers are
    spawned)."""
    from fusesearch.sweep import load_config, run_sweep

    config = Path(config)
    cfg = load_config(config)
    if threads is not None:
        cfg = dataclasses.replace(cfg, threads=threads)
    return Swept(cfg.name, cfg.threads, run_sweep(cfg, Path(out) if out is not None else config.parent / config.stem, workers=workers,
                           scheduler=scheduler, force=force, progress=progress))
