"""Measure a plan: run every kernel of the plan and of the unfused graph on real data.

Problem: the cost model's predictions are only claims until each chosen kernel runs; a plan's
worth is its measured speedup over running every node alone.
Approach: real data first — ONNX Runtime runs the canonical model on seeded valid inputs and keeps
every tensor (`verify.all_values`), so each kernel reads the inputs it would see in the model and
its outputs are checked against ONNX Runtime's (max relative error). Each group runs as its
generated kernel (CPU: C/OpenMP via cc; GPU: CUDA via CuPy) or, for opaque ops, as a library call
(ONNX Runtime on CPU); it is timed by `backends.timing.measure` (perf_counter on CPU, CUDA events
on GPU), cached by (source hash, shapes, device). The same is done for the unfused plan (every
node its own kernel). One row per kernel goes to a table (KernelSpec fields, prediction,
measurement, ptxas resources where known) for Parquet and calibration.
Invariants: nothing is written unless asked; a kernel that cannot run on the backend (an opaque
op on the GPU) is reported as not measured, never silently timed as zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fusesearch.backends.codegen import CodegenRefused, generate
from fusesearch.backends.timing import PerfCounterClock, Timing, TimingCache, measure
from fusesearch.errors import BadInput
from fusesearch.ir.canonicalize import to_proto
from fusesearch.plans import Plan
from fusesearch.verify import all_values, random_feeds

BACKENDS = ("cpu", "cupy")


@dataclass(frozen=True)
class KernelMeasurement:
    plan: str  # "plan" | "unfused"
    group: int
    template: str
    how: str  # "generated" | "library" | "not measured"
    predicted_s: float
    timing: Timing | None
    max_rel_err: float
    row: dict = field(default_factory=dict)

    @property
    def measured_s(self) -> float:
        return self.timing.median_s if self.timing is not None else math.nan


@dataclass(frozen=True)
class MeasureReport:
    backend: str
    device: str
    plan: tuple[KernelMeasurement, ...]
    unfused: tuple[KernelMeasurement, ...]

    @staticmethod
    def _total(items, attr) -> float:
        return float(sum(getattr(m, attr) for m in items if m.timing is not None))

    def totals(self) -> dict:
        measured = self._total(self.plan, "measured_s")
        unfused = self._total(self.unfused, "measured_s")
        return {"predicted_s": self._total(self.plan, "predicted_s"), "measured_s": measured,
                "unfused_predicted_s": self._total(self.unfused, "predicted_s"), "unfused_measured_s": unfused,
                "speedup": unfused / measured if measured else math.nan,
                "not_measured": sum(m.timing is None for m in (*self.plan, *self.unfused))}

    def to_dict(self) -> dict:
        groups = [{"id": m.group, "template": m.template, "how": m.how, "predicted_s": m.predicted_s,
                   "measured_s": m.measured_s, "p20_s": m.timing.p20_s if m.timing else math.nan,
                   "p80_s": m.timing.p80_s if m.timing else math.nan, "max_rel_err": m.max_rel_err}
                  for m in self.plan]
        return {"backend": self.backend, "device": self.device, "groups": groups, "totals": self.totals()}

    def to_pandas(self):
        import pandas as pd

        return pd.DataFrame([m.row for m in (*self.plan, *self.unfused)])


def measure_plan(prep, plan: Plan, unfused: Plan, backend: str, *, budget_s: float = 0.2, seed: int = 0,
                 progress: Callable[[str], None] | None = None, cache: TimingCache | None = None,
                 ptxas_arch: str | None = None, flush_l2: bool = False) -> MeasureReport:
    """`cache`: reuse timings keyed by (source hash, shapes, device, budget); `ptxas_arch`: also
    compile each generated CUDA kernel for this arch and record ptxas's registers, spills and
    shared memory beside the cost model's estimate; `flush_l2`: evict L2 before every GPU sample."""
    if backend not in BACKENDS:
        raise BadInput(f"--backend {backend}: choose one of {', '.join(BACKENDS)}")
    runner = _Runner(prep, backend, budget_s, seed, cache)
    runner.ptxas_arch = ptxas_arch
    runner.before_each = _l2_flush() if flush_l2 and backend == "cupy" else None
    done = []
    for label, p in (("plan", plan), ("unfused", unfused)):
        items = []
        for g in p.groups:
            items.append(runner.measure(label, g))
            if progress:
                progress(label)
        done.append(tuple(items))
    return MeasureReport(backend, runner.device, done[0], done[1])


class _Runner:
    def __init__(self, prep, backend: str, budget_s: float, seed: int, cache: TimingCache | None) -> None:
        self.prep, self.backend, self.budget_s, self.cache = prep, backend, budget_s, cache
        self.canonical = to_proto(prep.canonical)
        self.values = all_values(self.canonical, random_feeds(self.canonical, seed))
        self.device = _device_label(backend)
        self.clock = PerfCounterClock() if backend == "cpu" else _gpu_clock()
        self.ptxas_arch: str | None = None
        self.before_each = None

    def measure(self, label: str, g) -> KernelMeasurement:
        kernel, graph = g.kernel, self.prep.graph
        if kernel.alias:  # a view: no kernel runs (as the prediction says)
            timing = Timing((0.0,), 0, "alias")
            return KernelMeasurement(label, g.id, "alias", "alias", 0.0, timing, 0.0,
                                     self._row(label, g, "alias", timing, 0.0, None))
        try:
            generated = generate(graph, kernel, name=f"fs_{label}_{g.id}")
        except CodegenRefused:
            generated = None
        run, fetch, how, key = self._prepare(kernel, generated)
        if run is None:
            return KernelMeasurement(label, g.id, _template(g), how, g.cost.time_s, None, math.nan,
                                     self._row(label, g, how, None, math.nan, generated))
        run()
        err = _max_rel_err(fetch(), self.values)
        timing = self.cache.get(key) if self.cache and key else None
        if timing is None:
            timing = measure(run, clock=self.clock, budget_s=self.budget_s, before_each=self.before_each)
            if self.cache and key:
                self.cache.put(key, timing)
        return KernelMeasurement(label, g.id, _template(g), how, g.cost.time_s, timing, err,
                                 self._row(label, g, how, timing, err, generated))

    def _prepare(self, kernel, generated):
        inputs = {t: self.values[t] for t in kernel.inputs}
        shapes = [list(self.values[t].shape) for t in kernel.inputs]
        if generated is not None and self.backend == "cpu":
            from fusesearch.backends import cpu

            go = cpu.runner(generated, inputs)
            outputs = dict(zip((a.tensor for a in generated.outputs), go.buffers[len(generated.inputs):], strict=True))
            return go, lambda: outputs, "generated", self._key(generated, shapes)
        if generated is not None:
            from fusesearch.backends import cupy as gpu

            launch, fetch = gpu.kernel_runner(generated, inputs)
            return launch, fetch, "generated", self._key(generated, shapes)
        if self.backend == "cpu":
            from fusesearch.backends.library import library_runner

            go, _ = library_runner(self.canonical, self.prep.graph, kernel, inputs)
            state: dict = {}

            def run() -> None:
                state["out"] = go()

            return run, lambda: state["out"], "library", None
        return None, None, "not measured", None

    def _key(self, generated, shapes) -> str:
        extra = f"budget={self.budget_s};flush={self.before_each is not None}"
        return TimingCache.key(generated.source_hash, shapes, self.device, extra)

    def _ptxas(self, generated) -> dict:
        """ptxas's view of the generated CUDA kernel (where a CUDA compiler is present)."""
        if generated is None or not self.ptxas_arch:
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
               "predicted_spill_bytes": g.cost.spill_bytes, "max_rel_err": err, "backend": self.backend,
               "device": self.device, "source_hash": generated.source_hash if generated else None}
        row["tile"] = "x".join(map(str, row["tile"]))
        row["op_types"] = "+".join(row["op_types"])
        row.update(timing.to_row() if timing else {"median_s": math.nan, "p20_s": math.nan, "p80_s": math.nan, "n": 0})
        row.update(self._ptxas(generated))
        return row


def _template(g) -> str:
    return "alias" if g.kernel.alias else g.kernel.template


def _max_rel_err(outputs: dict, values: dict) -> float:
    worst = 0.0
    for name, got in outputs.items():
        ref = np.asarray(values[name], dtype=np.float64)
        got = np.asarray(got, dtype=np.float64).reshape(ref.shape)
        if ref.size:
            scale = max(1.0, float(np.max(np.abs(ref))))
            worst = max(worst, float(np.nanmax(np.abs(got - ref))) / scale)
    return worst


def _device_label(backend: str) -> str:
    if backend == "cpu":
        from costmodels import host_cpu

        return host_cpu().name
    from fusesearch.backends import cupy as gpu

    decision = gpu.available()
    if not decision:
        raise BadInput(f"--backend cupy: {decision.reason}; use --backend cpu on this machine")
    return gpu.device_name()


def _l2_flush():
    from fusesearch.backends import cupy as gpu

    return gpu.l2_flusher(gpu.l2_bytes())


def _gpu_clock():
    from fusesearch.backends.cupy import CudaEventClock

    return CudaEventClock()
