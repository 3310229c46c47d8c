"""Measure a plan: run every kernel of the plan and of the unfused graph on real data.

Problem: predictions are claims until each kernel runs; a plan's worth is its measured speedup over
every node alone, and a fused anchor must also beat "library anchor + separate epilogue".
Approach: ONNX Runtime runs the canonical model on seeded inputs, keeping every tensor
(`verify.all_values`); each kernel reads its real inputs and is checked against them. A group runs
as alias (0 s), a library call (lone anchors per the baseline, refused opaque ops; a refused fused
group as "library per node"), or its generated kernel. All are prepared first, then timed together
by the `registry.Backend`'s `sample` in ROUNDS interleaved passes (CPU: `timing.measure_interleaved`;
GPU: `timing.graph_timing`); ORT's Run cost (`library.run_costs`) and the ctypes call
(`cpu.null_runner`, `registry.NullCalls`, `CallCosts.net`, at least CALL_FLOOR_S) are taken off.
`MeasureReport.library_comparison` sets fused groups beside library + rest; rows feed calibration.
Invariants: nothing is written unless asked; a kernel that cannot run is "not measured" with its
reason, never timed as zero; a missing comparison is NaN / None, never a guess; timings are cached
by (source hash, shapes, device)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fusesearch.backends.codegen import CodegenRefused, generate
from fusesearch.backends.registry import Backend, get_backend
from fusesearch.backends.timing import Timing, TimingCache, warn_if_loaded
from fusesearch.errors import BadInput
from fusesearch.ir.canonicalize import to_proto
from fusesearch.layout import laid_out
from fusesearch.plans import Plan
from fusesearch.verify import (
    all_values,
    check_reference_dtypes,
    max_rel_err,
    omp_threads,
    random_feeds,
)

BASELINES = ("library", "generated")  # how lone anchors run (in the plan and the unfused graph)
PER_NODE = "library per node"  # how a group the generator refuses runs: each node alone, summed
@dataclass(frozen=True)
class KernelMeasurement:
    plan: str  # "plan" | "unfused"
    group: int
    template: str
    how: str  # "generated" | "library" | "library per node" | "not measured" | "alias"
    predicted_s: float
    timing: Timing | None
    max_rel_err: float
    row: dict = field(default_factory=dict)
    nodes: tuple[int, ...] = ()
    anchor: int | None = None
    reason: str = ""  # why not measured, or why it ran node by node (the generator's refusal)

    @property
    def measured_s(self) -> float:
        return self.timing.median_s if self.timing is not None else math.nan


@dataclass(frozen=True)
class MeasureReport:
    backend: str
    device: str
    plan: tuple[KernelMeasurement, ...]
    unfused: tuple[KernelMeasurement, ...]
    baseline: str = "library"

    @staticmethod
    def _total(items, attr) -> float:
        return math.fsum(getattr(m, attr) for m in items if m.timing is not None)

    @staticmethod
    def _spread(items) -> tuple[float, float]:
        """The sum of the kernels' p20s and of their p80s: the range their summed median moves in."""
        timed = [m.timing for m in items if m.timing is not None]
        return math.fsum(t.p20_s for t in timed), math.fsum(t.p80_s for t in timed)

    def totals(self) -> dict:
        """Sums over the kernels, each timed alone (`measured_s`: the sum of medians, with the sums
        of their p20s and p80s; not a run of the whole program, which `run` times), and
        `speedup_verdict`: "not distinguishable" where the two sums' ranges overlap
        (`timing.compared`)."""
        from fusesearch.backends.timing import compared

        measured = self._total(self.plan, "measured_s")
        unfused = self._total(self.unfused, "measured_s")
        spread, unfused_spread = self._spread(self.plan), self._spread(self.unfused)
        return {"predicted_s": self._total(self.plan, "predicted_s"), "measured_s": measured,
                "measured_p20_s": spread[0], "measured_p80_s": spread[1],
                "unfused_predicted_s": self._total(self.unfused, "predicted_s"), "unfused_measured_s": unfused,
                "unfused_measured_p20_s": unfused_spread[0], "unfused_measured_p80_s": unfused_spread[1],
                "speedup": unfused / measured if measured else math.nan,
                "speedup_verdict": compared(spread, unfused_spread, "plan faster", "unfused faster"),
                "not_measured": sum(m.timing is None for m in (*self.plan, *self.unfused))}

    def library_comparison(self) -> dict[int, dict]:
        """Plan group id → the fused kernel against its library baseline, for every group that
        fuses an anchor with other ops: `anchor_library_s` (the anchor alone through the library,
        from the unfused run), `rest_separate_s` (the group's other nodes, each its own kernel, from
        the unfused run), their sum `library_baseline_s`, `measured_s`, and `fused_loses`
        (measured > baseline; None when a part was not measured, when the unfused anchor did not run
        through the library, as under baseline "generated", or when the group did not run as one
        generated kernel but node by node). A lone anchor the plan ran as our kernel is set beside
        the same anchor through the library (`alone` True, no rest; `fused_loses` None, `ours_loses`
        whether ours is the slower)."""
        alone = {m.nodes[0]: m for m in self.unfused if len(m.nodes) == 1}
        out = {}
        for m in self.plan:
            if m.anchor is None:
                continue
            if len(m.nodes) == 1:
                lib = alone.get(m.anchor)
                if m.how == "generated" and lib is not None and lib.how == "library":
                    known = not (math.isnan(lib.measured_s) or math.isnan(m.measured_s))
                    out[m.group] = {"anchor_library_s": lib.measured_s, "rest_separate_s": 0.0,
                                    "library_baseline_s": lib.measured_s, "measured_s": m.measured_s,
                                    "fused_loses": None, "alone": True,
                                    "ours_loses": bool(m.measured_s > lib.measured_s) if known else None}
                continue
            lib = alone.get(m.anchor)
            anchor_s = lib.measured_s if lib is not None and lib.how == "library" else math.nan
            rest_s = math.fsum(alone[i].measured_s if i in alone else math.nan for i in m.nodes if i != m.anchor)
            baseline_s = anchor_s + rest_s
            known = m.how == "generated" and not (math.isnan(baseline_s) or math.isnan(m.measured_s))
            out[m.group] = {"anchor_library_s": anchor_s, "rest_separate_s": rest_s, "library_baseline_s": baseline_s,
                            "measured_s": m.measured_s, "fused_loses": bool(m.measured_s > baseline_s) if known else None,
                            "alone": False}
        return out

    def to_dict(self) -> dict:
        versus = self.library_comparison()
        groups = [{"id": m.group, "template": m.template, "how": m.how, "predicted_s": m.predicted_s,
                   "median_s": m.measured_s, "p20_s": m.timing.p20_s if m.timing else math.nan,
                   "p80_s": m.timing.p80_s if m.timing else math.nan, "n": m.timing.n if m.timing else 0,
                   "max_rel_err": m.max_rel_err,
                   "library_baseline_s": _none_if_nan(versus.get(m.group, {}).get("library_baseline_s")),
                   "fused_loses": versus.get(m.group, {}).get("fused_loses"),
                   **(m.timing.how_timed() if m.timing else {}), **({"reason": m.reason} if m.reason else {})}
                  for m in self.plan]
        fused = [v for v in versus.values() if not v["alone"]]
        compared = [v for v in fused if v["fused_loses"] is not None]
        lone = [v for v in versus.values() if v["alone"] and v["ours_loses"] is not None]
        totals = {**self.totals(), "anchor_groups": len(fused), "anchor_groups_compared": len(compared),
                  "fused_loses": sum(v["fused_loses"] for v in compared), "lone_anchors_compared": len(lone),
                  "lone_ours_loses": sum(v["ours_loses"] for v in lone)}
        return {"backend": self.backend, "device": self.device, "baseline": self.baseline, "groups": groups,
                "totals": totals}

    def to_pandas(self):
        import pandas as pd

        versus = self.library_comparison()
        rows = []
        for m in (*self.plan, *self.unfused):
            v = versus.get(m.group, {}) if m.plan == "plan" else {}
            rows.append({**m.row, "library_baseline_s": v.get("library_baseline_s", math.nan),
                         "fused_loses": v.get("fused_loses"), "baseline": self.baseline})
        return pd.DataFrame(rows)


def measure_plan(prep, plan: Plan, unfused: Plan, backend: Backend | str, *, budget_s: float = 0.2, seed: int = 0,
                 progress: Callable[[str], None] | None = None, cache: TimingCache | None = None,
                 ptxas_arch: str | None = None, flush_l2: bool = False,
                 baseline: str = "library", input_values: dict[str, np.ndarray] | None = None,
                 sampler: Callable[..., list[Timing]] | None = None) -> MeasureReport:
    """`backend`: a registered backend that times, or its name; `cache`: reuse timings keyed by (source hash, shapes, device, budget); `ptxas_arch`: also
    compile each generated CUDA kernel for this arch and record ptxas's registers, spills and
    shared memory beside the cost model's estimate; `flush_l2`: evict L2 before every launch
    (a GPU's rows say `cache` "flushed", else "warm", for the plan and the unfused graph alike);
    `baseline`: "library" runs the unfused graph's lone anchors through the library, "generated"
    as generated kernels (the plan's run as the plan says);
    `input_values`: inputs given by the user (`verify.parse_input_values`), the rest drawn;
    `sampler`: times the runs (default `backend.sample`: its arguments and result; a test passes fixed
    samples, so what is taken off them is checked whatever the machine's speed)."""
    backend = get_backend(backend)
    if baseline not in BASELINES:
        raise BadInput(f"--baseline {baseline}: choose one of {', '.join(BASELINES)}")
    for label, p in (("plan", plan), ("unfused", unfused)):
        check_reference_dtypes(prep.graph, label, p, "measure")
    runner = _Runner(prep, backend, budget_s, seed, cache, input_values)
    runner.baseline = baseline
    runner.ptxas_arch = ptxas_arch
    runner.flush_l2 = flush_l2
    items = {}
    for label, p in (("plan", plan), ("unfused", unfused)):
        for g in p.groups:
            items[label, g.id] = runner.prepare(label, g)
            if progress:
                progress(label)
    todo = [it for it in _paired_order(plan, unfused, items) if it.run is not None and it.timing is None]
    # what the calling path adds and a program never pays (a ctypes call, ONNX Runtime's Run),
    # timed among the rest where a kernel of that kind is
    nulls = backend.null_calls(library=any(it.how in ("library", PER_NODE) for it in todo),
                               generated=any(it.how == "generated" for it in todo))
    warn_if_loaded(1 if backend.cuda else max(omp_threads(), 1))  # a GPU's launches: one host thread
    timings = (sampler or backend.sample)([it.run for it in todo] + list(nulls.runs), budget_s=budget_s,
                                          rounds=ROUNDS, flush=flush_l2)
    costs = nulls.costs([t.median_s for t in timings[len(todo):]])
    for it, timing in zip(todo, timings[:len(todo)], strict=True):
        it.timing = costs.net(it.how, timing, len(it.group.kernel.nodes))  # one Run per library call
        if runner.cache and it.key:
            runner.cache.put(it.key, it.timing)
    done = [tuple(runner.finish(items[label, g.id]) for g in p.groups) for label, p in (("plan", plan), ("unfused", unfused))]
    return MeasureReport(backend.name, runner.device, done[0], done[1], baseline)


ROUNDS = 5  # passes over every kernel; each gets budget_s / ROUNDS per pass


def _paired_order(plan: Plan, unfused: Plan, items: dict) -> list[_Item]:
    """Every item, each plan group followed by the unfused kernels of its nodes (those not yet
    placed), then the unfused kernels left: a fused kernel and what it replaces are timed seconds
    apart in every round."""
    by_node = {g.nodes[0]: items["unfused", g.id] for g in unfused.groups if len(g.nodes) == 1}
    order, placed = [], set()
    for g in plan.groups:
        order.append(items["plan", g.id])
        for n in g.nodes:
            it = by_node.get(n)
            if it is not None and id(it) not in placed:
                order.append(it)
                placed.add(id(it))
    order += [items["unfused", g.id] for g in unfused.groups if id(items["unfused", g.id]) not in placed]
    return order


@dataclass
class _Item:
    """One kernel of the plan or the unfused graph, between `prepare` and `finish`."""

    label: str
    group: object
    how: str
    run: Callable[[], None] | None = None
    key: str | None = None
    timing: Timing | None = None
    err: float = math.nan
    generated: object = None
    reason: str = ""


class _Runner:
    def __init__(self, prep, backend: Backend, budget_s: float, seed: int, cache: TimingCache | None,
                 input_values: dict[str, np.ndarray] | None = None) -> None:
        self.prep, self.backend, self.budget_s, self.cache = prep, backend, budget_s, cache
        self.canonical = to_proto(prep.canonical)
        self.values = all_values(self.canonical, random_feeds(self.canonical, seed, input_values),
                                 list(input_values or ()))
        self.device = backend.device_label()
        self.ptxas_arch: str | None = None
        self.flush_l2 = False
        self.baseline = "library"

    def prepare(self, label: str, g) -> _Item:
        """Generate, compile and run the group's kernel once (its error against ONNX Runtime's
        values); its timing is left to `measure_plan`'s interleaved rounds unless cached."""
        kernel, graph = g.kernel, self.prep.graph
        if kernel.alias:  # a view: no kernel runs (as the prediction says)
            return _Item(label, g, "alias", timing=Timing((0.0,), 0, "alias"), err=0.0)
        # a lone anchor: the plan's as the plan prices it, the unfused graph's as the baseline says
        library = kernel.impl == "library" if label == "plan" else self.baseline == "library"
        generated, why = None, ("the plan runs this lone anchor as a library call" if label == "plan" else
                                "a lone anchor runs through the library (baseline library)")
        if not (library and len(kernel.nodes) == 1 and kernel.anchor is not None):
            try:
                generated = generate(graph, kernel, name=f"fs_{label}_{g.id}")
            except CodegenRefused as exc:
                why = str(exc)
        run, fetch, how, key, reason = self._prepare(kernel, generated, f"{label} group g{g.id}")
        if run is None:
            return _Item(label, g, how, generated=generated, reason=f"{reason} ({why})")
        run()
        err = max_rel_err(fetch(), self.values)
        timing = self.cache.get(key) if self.cache and key else None
        return _Item(label, g, how, run=run, key=key, timing=timing, err=err, generated=generated,
                     reason=why if how == PER_NODE else "")

    def finish(self, item: _Item) -> KernelMeasurement:
        g, how, timing = item.group, item.how, item.timing
        ids = dict(nodes=tuple(g.nodes), anchor=g.kernel.anchor)
        if how == "alias":
            return KernelMeasurement(item.label, g.id, "alias", "alias", 0.0, timing, 0.0,
                                     self._row(item.label, g, "alias", timing, 0.0, None), **ids)
        row = self._row(item.label, g, how, timing, item.err, item.generated)
        if item.reason:
            row["reason"] = item.reason
        return KernelMeasurement(item.label, g.id, _template(g), how, g.cost.time_s, timing, item.err, row,
                                 reason=item.reason, **ids)

    def _prepare(self, kernel, generated, where: str):
        """(run, fetch, how, cache key, why not measured) for the group's kernel; `where` names the
        group in errors."""
        inputs = {t: self.values[t] for t in kernel.inputs}
        shapes = [list(self.values[t].shape) for t in kernel.inputs]
        if generated is not None:
            run, fetch = laid_out(self.backend.runner, generated, inputs, {t: v.shape for t, v in self.values.items()})
            return run, fetch, "generated", self._key(generated, shapes), ""
        how = "library" if len(kernel.nodes) == 1 or kernel.schedule.library else PER_NODE
        calls = []
        for part in self._parts(kernel):
            call, why = self._library(part, where)
            if call is None:
                return None, None, "not measured", None, why
            calls.append(call)

        def run() -> None:  # each node on its reference inputs, one after another
            for launch, _ in calls:
                launch()

        def fetch() -> dict:
            outputs = {t: y for _, got in calls for t, y in got().items()}
            return {t: outputs[t] for t in kernel.outputs}

        return run, fetch, how, None, ""

    def _parts(self, kernel) -> list:
        """The kernel itself when it is one node or one library call (a conv group's fused cuDNN
        graph), else one library Kernel per node."""
        if len(kernel.nodes) == 1 or kernel.schedule.library:
            return [kernel]
        from fusesearch.groups import FusionGroup
        from fusesearch.lowering import lower_as_library

        return [lower_as_library(self.prep.graph, FusionGroup.single(i)) for i in kernel.nodes]

    def _library(self, part, where: str):
        """((run, fetch), "") of one node through the backend's library, run once, or (None, why)
        where the library has no kernel for it; where the library runs every op (ONNX Runtime),
        its refusal is the model's: BadInput naming the group, the op and the dtypes."""
        try:
            call, why = self.backend.library_call(self.canonical, self.prep.graph, part, self.values)
            if call is not None:
                call[0]()
        except Exception as exc:  # ONNX Runtime's refusal (or a dtype numpy lacks): the user's model
            if not self.backend.library_has_every_op:
                raise
            graph = self.prep.graph
            node = graph.nodes[part.nodes[0]]
            dtypes = [",".join(dict.fromkeys(graph.tensors[t].dtype for t in ts if t in graph.tensors)) or "-"
                      for ts in (node.inputs, node.outputs)]
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise BadInput(f"{where}: node '{node.name}' ({node.op_type}, {dtypes[0]} -> {dtypes[1]}) has no "
                           f"generated kernel and cannot run alone through {self.backend.library} ({first}); "
                           f"measure cannot time this model on --backend {self.backend.name}") from None
        return call, why

    def _key(self, generated, shapes) -> str:
        extra = f"budget={self.budget_s};flush={self.flush_l2};net of the call"
        extra += self.backend.timing_key()
        return TimingCache.key(generated.source_hash, shapes, self.device, extra)

    def _ptxas(self, generated) -> dict:
        """ptxas's view of the generated CUDA kernel (where a CUDA compiler is present)."""
        if generated is None or not self.ptxas_arch or not generated.cuda_source:  # none, or a CPU schedule
            return {}
        from fusesearch.backends import nvrtc

        try:
            res = nvrtc.compile_cuda(generated.cuda_source, arch=self.ptxas_arch).resource(generated.name)
        except Exception as exc:  # recorded, not fatal: the row says why
            return {"ptxas_error": str(exc)[:200]}
        return {"ptxas_arch": res.arch, "ptxas_registers": res.registers, "ptxas_smem_bytes": res.smem_bytes,
                "ptxas_spill_bytes": res.spill_store_bytes + res.spill_load_bytes, "ptxas_stack_bytes": res.stack_bytes}

    def _row(self, label, g, how, timing: Timing | None, err: float, generated) -> dict:
        row = {"plan": label, "group": g.id, "how": how, "nodes": "+".join(self.prep.graph.nodes[i].name for i in g.nodes),
               **g.kernel.spec().to_row(), "predicted_s": g.cost.time_s, "predicted_bound": g.cost.bound,
               "predicted_occupancy": g.cost.occupancy, "predicted_regs_per_thread": g.cost.regs_per_thread,
               "predicted_spill_bytes": g.cost.spill_bytes, "compute_unit": g.cost.compute_unit,
               "max_rel_err": err, "backend": self.backend.name,
               "device": self.device, "source_hash": generated.source_hash if generated else None,
               "skeleton": generated.skeleton if generated else None,
               "cuda_grid": "x".join(map(str, generated.grid)) if generated else None}
        row.update(timing.to_row() if timing else {"median_s": math.nan, "p20_s": math.nan, "p80_s": math.nan, "n": 0})
        row.update(self._ptxas(generated))
        return row


def _none_if_nan(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


def _template(g) -> str:
    return "alias" if g.kernel.alias else g.kernel.template
