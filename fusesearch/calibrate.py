"""Calibration: fit the roofline model to measured kernels and report its held-out accuracy.

Problem: default efficiencies are guesses; the device's real behaviour must be measured, fitted,
and the fit judged on kernels left out of it.
Approach: enumerate candidates, sample seeded round-robin over strata (template, size bin), skipping
duplicate KernelSpecs and refused kernels; measure each as the plan runs it (generated, or a lone
anchor through the library, so `library_efficiency` fits the library) on real data
(`verify.all_values`), the least of R rounds' medians, net of call costs as `measure` does; split
held-out kernels per (seed, template) by group; fit RooflineParams in two stages (shared terms,
then gemm/conv efficiencies); per template keep the defaults where the fit predicts worse on
cross-validation ("kept_defaults"); report MAPE, median APE, Spearman, Kendall before/after, and
the register model vs ptxas. The fit and metrics are pure, in `costmodels.calibration`.
Invariants: sampling, split and fit are deterministic per seed; the model evaluated is always
`RooflineModel.cost` itself; a profile is only used on the device it was fitted on
(`check_profile_for_backend`)."""

from __future__ import annotations

import json
import logging
import math
import platform
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from costmodels import (
    DEVICES,
    DeviceSpec,
    KernelSpec,
    Profile,
    RooflineModel,
    RooflineParams,
    estimate_registers,
)
from costmodels.calibration import (
    REGISTER_ARCH,
    SHARED_TERMS,
    FitResult,
    accuracy,
    cross_validate,
    error_factor,
    fit,
    fit_registers,
    fit_staged,
    free_parameters,
    keep_shared,
    keep_start,
    kendall,
    part_of,
    predict,
    spearman,
)
from costmodels.profile import default_versions, installed_versions
from fusesearch.backends.registry import Backend, get_backend, table_name_for_gpu
from fusesearch.costing import device_choices
from fusesearch.errors import BadInput
from fusesearch.groups import FusionGroup
from fusesearch.lowering import lower
from fusesearch.verify import max_rel_err

log = logging.getLogger(__name__)

DEFAULT_MODELS = {"cpu": ("bert-small", "resnet18", "mobilenetv2", "vit-small"),
                  "cupy": ("bert-base", "resnet50", "mobilenetv2", "vit-base", "gpt2", "yolo-neck",
                           "unet")}
TEMPLATES = ("pointwise", "rowwise", "gemm", "conv", "conv_disjoint", "depthwise")  # what codegen generates
SIZE_BINS = 4
HELDOUT_FRACTION = 0.3
MAX_KERNEL_S = {"cpu": 0.25, "cupy": 0.05}  # a first run slower than this is skipped (counted)
BUDGET_S = {"cpu": 0.015, "cupy": 0.02}  # per kernel and round
ROUNDS = {"cpu": 5, "cupy": 2}


# -- sampling ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    """One sampled group: where it comes from, its kernel, and its stratum."""

    model: str
    key: str  # model:node+node+... (the split unit)
    nodes: frozenset[int]
    kernel: object  # fusesearch.lowering.Kernel
    template: str
    size_bin: int


@dataclass(frozen=True)
class Sample:
    candidates: tuple[Candidate, ...]
    counts: Mapping[str, int]  # enumerated / per-stratum availability / refused / duplicates


def _kind(kernel) -> str:
    """The sampling stratum's kind: the template, `template/library` for a library call."""
    return f"{kernel.template}/library" if runs_through_library(kernel) else kernel.template


def _work(kernel) -> float:
    spec = kernel.spec()
    return math.log10(1.0 + spec.flops + spec.dram_bytes)


def _size_bins(values: Sequence[float], bins: int) -> list[int]:
    """Quantile bin (0..bins-1) of each value."""
    if not values:
        return []
    edges = np.quantile(np.asarray(values), np.linspace(0, 1, bins + 1)[1:-1])
    return [int(np.searchsorted(edges, v, side="right")) for v in values]


def enumerate_pool(preps: Mapping[str, object], device: DeviceSpec, params: RooflineParams,
                   templates: Iterable[str] = TEMPLATES) -> list[tuple[str, frozenset[int], object]]:
    """Every legal, non-alias candidate of each model whose template is generated: (model, nodes,
    kernel), in a deterministic order. A lone anchor is its library call, also where a CPU plan
    runs it as our C (`costing.cheapest` chooses by both efficiencies): `library_efficiency`
    is fitted on those calls, the generated efficiencies on the fused groups, whose C is the same
    product with a prologue and an epilogue. On a CPU a fused gemm/conv is there once per C
    product it can run as (`costing.device_choices`), not only as its cheapest, so that a
    template's sample holds its products and the fit sees each one's rate
    (`RooflineParams.product_efficiency`)."""
    from fusesearch.backends import cpu
    from fusesearch.candidates.enumerate import enumerate_candidates
    from fusesearch.candidates.rules import Legality

    wanted = set(templates)
    pool = []
    for name, prep in preps.items():
        legality = Legality(prep.graph, device, RooflineModel(params), cpu.capabilities())
        for nodes in enumerate_candidates(legality).groups:
            verdict = legality.check(nodes)
            kernel = verdict.kernel
            if not verdict.decision or kernel is None or kernel.alias or kernel.template not in wanted:
                continue
            if kernel.anchor is not None and len(nodes) == 1 and kernel.impl == "generated":
                kernel = lower(prep.graph, FusionGroup(nodes))  # a lone anchor: its library call
            pool.append((name, nodes, kernel))
            if kernel.schedule.product and len(nodes) > 1:  # a CPU product: the group's other products too
                pool += [(name, nodes, k) for k in device_choices(prep.graph, FusionGroup(nodes), device,
                                                                  legality.capabilities.blas)
                         if k.schedule.product not in ("", kernel.schedule.product)]
    return pool


def sample_candidates(preps: Mapping[str, object], device: DeviceSpec, params: RooflineParams,
                      samples: int, seed: int, *, bins: int = SIZE_BINS,
                      templates: Iterable[str] = TEMPLATES) -> Sample:
    """`samples` candidates stratified by (kind, size bin), seeded: a kind is a template, with a
    template's library calls (lone anchors, `runs_through_library`) a kind of their own, so the
    few library calls among many fused groups are sampled as often as the generated kernels and
    `library_efficiency` is fitted on them; kernels that codegen refuses and exact duplicates
    (same KernelSpec) are skipped and counted."""
    from fusesearch.backends.codegen import CodegenRefused, generate

    pool = enumerate_pool(preps, device, params, templates)
    by_kind: dict[str, list] = defaultdict(list)
    for item in pool:
        by_kind[_kind(item[2])].append(item)
    strata: dict[tuple[str, int], list] = {}
    for template in sorted(by_kind):
        items = by_kind[template]
        for item, b in zip(items, _size_bins([_work(k) for _, _, k in items], bins), strict=True):
            strata.setdefault((template, b), []).append(item)
    rng = np.random.default_rng(seed)
    queues = {key: [items[i] for i in rng.permutation(len(items))] for key, items in sorted(strata.items())}
    counts = {"enumerated": len(pool), "codegen_refused": 0, "duplicates": 0}
    seen: set[str] = set()
    chosen: list[Candidate] = []
    # round-robin: templates in turn, and within a template its size bins in turn
    order = [(t, b) for b in range(bins) for t in sorted(by_kind)]
    while len(chosen) < samples and any(queues.values()):
        for key in order:
            if len(chosen) >= samples:
                break
            queue = queues.get(key)
            while queue:
                name, nodes, kernel = queue.pop()
                signature = json.dumps(kernel.spec().to_row(), sort_keys=True)
                if signature in seen:
                    counts["duplicates"] += 1
                    continue
                graph = preps[name].graph
                try:
                    if not runs_through_library(kernel):  # a library call runs the library's kernel
                        generate(graph, kernel)
                except CodegenRefused:
                    counts["codegen_refused"] += 1
                    continue
                seen.add(signature)
                label = "+".join(graph.nodes[i].name for i in sorted(nodes))
                chosen.append(Candidate(name, f"{name}:{label}", nodes, kernel, kernel.template, key[1]))
                break
    for (template, b), items in sorted(strata.items()):
        counts[f"pool.{template}.bin{b}"] = len(items)
    return Sample(tuple(chosen), counts)


# -- measuring --------------------------------------------------------------------------------

@dataclass
class _ModelData:
    prep: object
    canonical: object  # the canonical model as ONNX (a library call runs its node from it)
    values: dict


def _model_data(prep, seed: int) -> _ModelData:
    from fusesearch.ir.canonicalize import to_proto
    from fusesearch.verify import all_values, random_feeds

    canonical = to_proto(prep.canonical)
    return _ModelData(prep, canonical, all_values(canonical, random_feeds(canonical, seed)))


def runs_through_library(kernel) -> bool:
    """A lone anchor (or opaque op) the plan runs as a library call: the cost model prices it with
    `library_efficiency`, so calibration times the library's own kernel (MLAS through ONNX Runtime
    on the CPU, the array library on a GPU), never the generated fallback it would fit instead."""
    return kernel.schedule.impl == "library"


def backend_device_name(backend: Backend | str) -> str:
    """The cost-model device a backend measures: 'host' on cpu; on cupy the table entry that
    matches the visible GPU (BadInput when there is no GPU, or when it matches no entry)."""
    return get_backend(backend).cost_device()


def check_profile_for_backend(device_arg: str | None, backend: Backend | str, *,
                              measured: str | None = None, threads: int | None = None) -> None:
    """A profile (a .json --device) may only be used where its device is the one measured:
    its `backend` must be this backend and its device name the backend's device ('host' on cpu,
    the visible GPU's table entry on cupy, or `measured` when given), a host profile's OpenMP
    threads the run's (`threads`: --threads; else OMP_NUM_THREADS). BadInput otherwise."""
    if not device_arg:
        return
    backend = get_backend(backend).name
    from costmodels import CostModelError, load_profile
    from costmodels.profile import load_device

    text = str(device_arg)
    looks_like_path = text.lower().endswith(".json") or "/" in text
    is_name = text.strip().lower() in (*DEVICES, "host", "cpu")
    if not (looks_like_path or (not is_name and Path(text).is_file())):
        return  # a table name (load_device's rule)
    try:
        load_device(text)
        profile = load_profile(text)
    except CostModelError as exc:
        raise BadInput(f"--device {text}: {exc}") from None
    if profile.backend and profile.backend != backend:
        raise BadInput(f"--device {text}: this profile was calibrated with --backend {profile.backend} "
                       f"on '{profile.device.name}', not for --backend {backend}; use a profile from "
                       f"`fusesearch calibrate --backend {backend}`")
    expected = measured or backend_device_name(backend)
    if profile.device.name != expected:
        raise BadInput(f"--device {text}: this profile is for device '{profile.device.name}', but "
                       f"--backend {backend} measures '{expected}'; calibrate a profile for "
                       f"'{expected}' or drop --device")
    if expected == "host":
        _check_same_host(text, profile.device, threads)


def _check_same_host(text: str, device: DeviceSpec, threads: int | None = None) -> None:
    """A host profile fits only the same CPU model run with the same number of OpenMP threads
    (`threads`, else OMP_NUM_THREADS's)."""
    from costmodels import host_cpu

    here = host_cpu(threads)
    cpu_of = lambda spec: (spec.sources[0].split(";")[0] if spec.sources else "")  # noqa: E731
    if cpu_of(device) and cpu_of(device) != cpu_of(here):
        raise BadInput(f"--device {text}: this profile is for another CPU ({cpu_of(device)}), this "
                       f"machine is {cpu_of(here)}; calibrate a profile here")
    if device.sm_count != here.sm_count:
        fix = f"--threads {device.sm_count}" if threads is not None else f"set OMP_NUM_THREADS={device.sm_count}"
        raise BadInput(f"--device {text}: this profile was calibrated with {device.sm_count} OpenMP "
                       f"thread(s), this run uses {here.sm_count}; {fix} (or calibrate again with this setting)")


def measure_candidates(candidates: Sequence[Candidate], preps: Mapping[str, object], backend: Backend | str,
                       device: DeviceSpec, params: RooflineParams, *, seed: int = 0,
                       budget_s: float | None = None, max_kernel_s: float | None = None,
                       progress: Callable[[Candidate], None] | None = None,
                       registers: bool = True, rounds: int | None = None) -> tuple[list[dict], dict[str, int]]:
    """Run each candidate on real data on the backend as the plan runs it (its generated kernel, or
    the library call a lone anchor is: `runs_through_library`), in `rounds` rounds over all
    candidates (so a kernel's rounds are far apart in time); one row per measured kernel
    (KernelSpec fields, how it ran, model prediction, measured time, ptxas registers of a generated
    kernel). `progress` is called once per candidate and round. Returns (rows, counts of skipped
    kernels by reason)."""
    backend = get_backend(backend)
    rounds = ROUNDS[backend.name] if rounds is None else rounds
    budget_s = BUDGET_S[backend.name] if budget_s is None else budget_s
    max_kernel_s = MAX_KERNEL_S[backend.name] if max_kernel_s is None else max_kernel_s
    runner = _Runner(backend)
    reg_ok = registers and _register_toolchain()
    from fusesearch.backends.cpu import openmp_threads

    with openmp_threads(device.sm_count if device.kind == "cpu" else 0):
        return _measure_all(candidates, preps, runner, RooflineModel(params), device, seed, budget_s,
                            max_kernel_s, progress, reg_ok, rounds)


def _measure_all(candidates, preps, runner, model, device, seed, budget_s, max_kernel_s, progress,
                 reg_ok, rounds) -> tuple[list[dict], dict[str, int]]:
    data: dict[str, _ModelData] = {}
    skipped: dict[str, int] = defaultdict(int)
    kept: list[tuple[Candidate, dict]] = []
    costs = runner.call_costs(budget_s)
    for cand in candidates:  # round 1: build, probe, check against ORT, time
        if cand.model not in data:
            data[cand.model] = _model_data(preps[cand.model], seed)
        row = _first_round(cand, data[cand.model], runner, budget_s, max_kernel_s, skipped)
        if row is not None:
            row["timings"] = [costs.net(row["how"], t) for t in row["timings"]]
            kept.append((cand, row))
        if progress:
            progress(cand)
    for _ in range(rounds - 1):  # later rounds, minutes apart for the same kernel
        costs = runner.call_costs(budget_s)
        for cand, row in kept:
            row["timings"].append(costs.net(row["how"], _time_round(cand, data[cand.model], runner, budget_s)))
            if progress:
                progress(cand)
    rows = []
    for cand, row in kept:
        rows.append(_finish_row(row, rows_model=model, cand=cand, device=device))
        if reg_ok:
            rows[-1].update(_ptxas_row(cand, data[cand.model].prep.graph, register_arch(device)))
    return rows, dict(skipped)


def _first_round(cand: Candidate, md: _ModelData, runner, budget_s: float, max_kernel_s: float,
                 skipped: dict) -> dict | None:
    import time

    try:
        call = runner.prepare(cand, md)
    except Exception as exc:  # a compiler's or the library's rejection is counted, not fatal
        log.warning("skipping %s: %s", cand.key, exc)
        skipped["library_refused" if runs_through_library(cand.kernel) else "compile_failed"] += 1
        return None
    if call is None:  # a library call the backend has no kernel for
        skipped["no_library_kernel"] += 1
        return None
    t0 = time.perf_counter()
    call.run()
    outputs = call.fetch()
    if time.perf_counter() - t0 > max_kernel_s:
        skipped["too_slow"] += 1
        return None
    err = max_rel_err(outputs, md.values)
    timing = call.timed(budget_s)
    return {"model": cand.model, "group": cand.key, "size_bin": cand.size_bin, "how": call.how,
            "source_hash": call.source_hash, "max_rel_err": err, "timings": [timing]}


def _time_round(cand: Candidate, md: _ModelData, runner, budget_s: float):
    call = runner.prepare(cand, md)
    return call.timed(budget_s)


def _timed(backend: Backend, run, budget_s: float, *, flush: bool):
    """`run` alone, warmed up then sampled for `budget_s` (5 to 2000 samples), by the backend's
    `sample`: on a GPU per launch from CUDA-graph replays, `flush` an L2 flush kernel before
    each launch (the rows' `cache` "flushed")."""
    return backend.sample([run], budget_s=budget_s, rounds=1, warmup_s=min(0.01, budget_s), flush=flush,
                          min_samples=5, max_samples=2000)[0]


def _finish_row(row: dict, *, rows_model: RooflineModel, cand: Candidate, device: DeviceSpec) -> dict:
    """measured_s = the least of the rounds' medians (contention only ever adds time, so the
    quietest round is the best estimate of the kernel's own median); all samples summarized too."""
    timings = row.pop("timings")
    medians = [t.median_s for t in timings]
    pooled = replace(timings[0], samples_s=tuple(s for t in timings for s in t.samples_s))  # timer, cache kept
    row.update(pooled.to_row())
    row.update({"rounds": len(timings), "round_medians_s": ",".join(f"{m:.4e}" for m in medians),
                "measured_s": min(medians)})
    row.update(_prediction_row(cand, rows_model, device))
    return row


@dataclass(frozen=True)
class _Call:
    """One candidate ready to time: how it runs ("generated" or "library"), the run, its outputs,
    the backend that times it, and what identifies its code."""

    how: str
    run: Callable[[], None]
    fetch: Callable[[], dict]
    backend: Backend
    source_hash: str

    def timed(self, budget_s: float):
        """The run's Timing, L2 flushed before each sample (each launch on a GPU)."""
        return _timed(self.backend, self.run, budget_s, flush=True)


def _library_label(graph, kernel) -> str:
    """What identifies a library call in the rows: the op and its input shapes (no source)."""
    node = graph.nodes[kernel.nodes[0]]
    shapes = ";".join("x".join(map(str, graph.tensors[t].shape or ())) for t in node.inputs if t)
    return f"library:{node.op_type}:{shapes}"


class _Runner:
    """Candidates on a backend, as `measure` runs them: a generated kernel through the backend's
    `runner`, a library call through its `library_call` (ONNX Runtime as inside a model on the
    CPU, the array library with CuPy on a GPU: None where it has no kernel), each timed by the
    backend's `sample` with L2 flushed (a GPU: per launch from CUDA-graph replays, a flush kernel
    before each launch in the graph; the rows say `timer` and `cache`). Each round's samples are net
    of what the calling path adds and a plan's program never pays per kernel (the backend's
    `null_calls`, timed between rounds: a C call that does nothing, ONNX Runtime's fixed cost of
    one Run; none on a GPU, whose events time the device's work alone)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def prepare(self, cand: Candidate, md: _ModelData) -> _Call | None:
        kernel, graph = cand.kernel, md.prep.graph
        if runs_through_library(kernel):
            call, _ = self.backend.library_call(md.canonical, graph, kernel, md.values)
            if call is None:
                return None
            return _Call("library", *call, self.backend, _library_label(graph, kernel))
        from fusesearch.backends.codegen import generate

        generated = generate(graph, kernel)
        run, fetch = self.backend.runner(generated, {t: md.values[t] for t in kernel.inputs})
        return _Call("generated", run, fetch, self.backend, generated.source_hash)

    def call_costs(self, budget_s: float):
        """The backend's CallCosts: its null calls' medians, timed now, between the rounds they
        are taken off."""
        nulls = self.backend.null_calls(library=True, generated=True)
        return nulls.costs([_timed(self.backend, r, budget_s, flush=False).median_s for r in nulls.runs])


def _prediction_row(cand: Candidate, model: RooflineModel, device: DeviceSpec) -> dict:
    spec = cand.kernel.spec()
    cost = model.cost(spec, device)
    row = spec.to_row()
    row.update({"predicted_before_s": cost.time_s, "predicted_bound": cost.bound,
                "predicted_regs_per_thread": cost.regs_per_thread})
    return row


def _register_toolchain() -> bool:
    from fusesearch.backends.nvrtc import toolchain_available

    decision = toolchain_available()
    if not decision:
        log.warning("register model check skipped: %s", decision.reason)
    return bool(decision)


def register_arch(device: DeviceSpec) -> str:
    from fusesearch.backends.nvrtc import ARCHES

    return device.arch if device.arch in ARCHES else REGISTER_ARCH


def _ptxas_row(cand: Candidate, graph, arch: str) -> dict:
    from fusesearch.backends.codegen import generate
    from fusesearch.backends.nvrtc import compile_cuda

    if runs_through_library(cand.kernel):  # the library's kernel, not ours: no source to compile
        return {}
    generated = generate(graph, cand.kernel)
    if not generated.cuda_source:  # a CPU schedule (packed): no CUDA form to compile
        return {}
    try:
        res = compile_cuda(generated.cuda_source, arch=arch).resource(generated.name)
    except Exception as exc:  # recorded, not fatal
        return {"ptxas_error": str(exc)[:200]}
    return {"ptxas_arch": res.arch, "ptxas_registers": res.registers,
            "ptxas_spill_bytes": res.spill_store_bytes + res.spill_load_bytes}


# -- split ------------------------------------------------------------------------------------

def split_groups(groups: Sequence[str], templates: Sequence[str], seed: int,
                 heldout_fraction: float = HELDOUT_FRACTION) -> np.ndarray:
    """Boolean mask, True = held out: within each template, a shuffle of its distinct groups
    seeded by (seed, template) — so one template's split does not depend on which others are
    present — and the first round(fraction x n) held out (at least one where a template has two)."""
    heldout: set[str] = set()
    by_template: dict[str, list[str]] = defaultdict(list)
    for g, t in zip(groups, templates, strict=True):
        if g not in by_template[t]:
            by_template[t].append(g)
    for t in sorted(by_template):
        keys = sorted(by_template[t])
        rng = np.random.default_rng([seed, zlib.crc32(t.encode())])
        order = rng.permutation(len(keys))
        n = int(round(heldout_fraction * len(keys)))
        n = max(n, 1) if len(keys) >= 2 else 0
        heldout.update(keys[i] for i in order[:n])
    return np.array([g in heldout for g in groups], dtype=bool)


# -- the whole calibration --------------------------------------------------------------------

@dataclass(frozen=True)
class Calibration:
    profile: Profile
    frame: object  # pandas.DataFrame, one row per measured kernel
    report: dict


def analyse(rows: Sequence[dict], device: DeviceSpec, start: RooflineParams, backend: str, seed: int,
            *, extra: Mapping | None = None) -> Calibration:
    """Split, fit and report on measured rows (as `measure_candidates` returns them)."""
    import pandas as pd

    frame = pd.DataFrame(list(rows))
    if len(frame) < 4:
        raise BadInput(f"only {len(frame)} kernels were measured; calibration needs at least 4 "
                       "(raise --samples or add --models)")
    frame = frame[frame["measured_s"] > 0].reset_index(drop=True)
    specs = [KernelSpec.from_row(r) for r in frame.to_dict("records")]
    held = split_groups(list(frame["group"]), list(frame["template"]), seed)
    frame["split"] = np.where(held, "heldout", "train")
    train_specs = [s for s, h in zip(specs, held, strict=True) if not h]
    result = fit_staged(train_specs, frame.loc[~held, "measured_s"].to_numpy(), device, start)
    params, kept = keep_where_worse(result.params, start, device, frame, specs, held, seed)
    registers = None
    if "ptxas_registers" in frame and frame["ptxas_registers"].notna().any():
        ok = frame["ptxas_registers"].notna().to_numpy()
        sub = frame[ok]
        registers = fit_registers([s.live_values_per_thread for s, o in zip(specs, ok, strict=True) if o],
                                  [s.dtype_bytes for s, o in zip(specs, ok, strict=True) if o],
                                  sub["ptxas_registers"].astype(int).tolist(), held[ok].tolist(), start,
                                  arch=register_arch(device))
        regs = registers["params_after"]
        if device.kind == "gpu":  # on a CPU the register estimate moves no prediction
            params = params.with_updates(**regs)
        registers["applied_to_profile"] = device.kind == "gpu"
    frame["predicted_before_s"] = predict(specs, device, start)
    frame["predicted_after_s"] = predict(specs, device, params)
    if registers is not None:
        frame["regs_estimate_after"] = [
            estimate_registers(s.live_values_per_thread, s.dtype_bytes, device.regs_per_thread_max,
                               base=registers["params_after"]["regs_base"],
                               per_value=registers["params_after"]["regs_per_live_value"]).regs_per_thread
            for s in specs]
    report = {
        "n_train": int((~held).sum()), "n_heldout": int(held.sum()),
        "heldout": _report_block(frame[held]),
        "train": _report_block(frame[~held]),
        "fit": {"method": "least squares on log time: coordinate search then Levenberg-Marquardt, "
                          "shared terms on anchor-free kernels first", "free": list(result.fitted),
                "train_loss_before": result.train_loss_before, "train_loss_after": result.train_loss_after,
                "iterations": result.iterations, "seed": seed},
        "kept_defaults": kept,
        "registers": registers,
        **dict(extra or {}),
    }
    profile = Profile(device, params, backend=backend, fit=report, versions=versions(backend))
    return Calibration(profile, frame, report)


def keep_where_worse(params: RooflineParams, start: RooflineParams, device: DeviceSpec, frame,
                     specs: Sequence[KernelSpec], held: np.ndarray, seed: int) -> tuple[RooflineParams, dict]:
    """Starting parameters instead of fitted ones where the fitted ones predict worse (a larger
    `error_factor`: the log error the fit minimizes, a factor off either way): first
    the shared terms with the anchor-free templates' own (the fit's first stage, over every kernel;
    `keep_shared`), then per part (a template's generated kernels, or its library calls: `part_of`)
    its own, on left-out folds of the training kernels (cross-validation), then, for the parts
    left, on the held-out kernels. Returns the parameters and {part or SHARED_TERMS: {"by",
    "kept_error", "fitted_error", "n"}} for each part kept."""
    measured = frame["measured_s"].to_numpy()
    train = [s for s, h in zip(specs, held, strict=True) if not h]
    kept: dict[str, dict] = {}
    cv = cross_validate(train, measured[~held], list(frame.loc[~held, "group"]), device, start, seed)
    shared = cv.pop(SHARED_TERMS, None)  # the first stage as a whole before any template's own
    if shared is not None and shared["fitted_error"] > shared["kept_error"]:
        params = keep_shared(params, start)
        kept[SHARED_TERMS] = {"by": "cross-validation", **shared}
    for t, c in cv.items():
        if c["fitted_error"] > c["kept_error"]:
            params = keep_start(params, start, t)
            kept[t] = {"by": "cross-validation", **c}
    parts = np.array([part_of(s) for s in specs])
    for t in sorted(set(parts[held]) - set(kept)):
        rows = held & (parts == t)
        sub = [s for s, r in zip(specs, rows, strict=True) if r]
        fitted = error_factor(predict(sub, device, params), measured[rows])
        candidate = keep_start(params, start, t)
        kept_error = error_factor(predict(sub, device, candidate), measured[rows])
        if fitted > kept_error:
            params = candidate
            kept[t] = {"by": "held-out", "n": len(sub), "fitted_error": fitted, "kept_error": kept_error}
    return params, kept


def _report_block(frame) -> dict:
    block = {"before": accuracy(frame["predicted_before_s"], frame["measured_s"]),
             "after": accuracy(frame["predicted_after_s"], frame["measured_s"]), "per_template": {}}
    for t in TEMPLATES:
        sub = frame[frame["template"] == t]
        if len(sub):
            block["per_template"][t] = {
                "before": accuracy(sub["predicted_before_s"], sub["measured_s"]),
                "after": accuracy(sub["predicted_after_s"], sub["measured_s"])}
    return block


def versions(backend: Backend | str) -> dict[str, str]:
    out = dict(default_versions())
    out.update({k: v for k, v in installed_versions(("onnx", "onnxruntime", "pandas", "pyarrow")).items() if v})
    out["platform"] = platform.platform()
    out.update(get_backend(backend).versions())
    return out


def resolve_calibration_device(backend: Backend | str, device_arg: str | None) -> tuple[DeviceSpec, RooflineParams]:
    """The device the backend measures, with starting parameters. `--device` may name it (it must
    be the measured one: 'host' on cpu, the visible GPU on cupy) or give a profile of it (its
    parameters are the starting point). BadInput for any mismatch."""
    from costmodels import CostModelError, load_device

    backend = get_backend(backend)
    measured = backend.cost_device()
    if device_arg is None:
        spec, params = load_device(measured)
        return spec, params
    text = str(device_arg)
    try:
        spec, params = load_device(text)
    except CostModelError as exc:
        raise BadInput(f"--device {text}: {exc}") from None
    check_profile_for_backend(text, backend, measured=measured)
    if spec.name != measured:
        raise BadInput(f"--device {text}: --backend {backend.name} measures '{measured}', not "
                       f"'{spec.name}'; calibrate on a machine with that device, or drop --device")
    if spec.name == "host":
        from costmodels import host_cpu

        spec = host_cpu()  # this machine's figures, even when the profile came from another run
    return spec, params


def calibrate(backend: Backend | str, *, device: str | None = None, models: Sequence[str] | None = None,
              samples: int = 240, seed: int = 0, budget_s: float | None = None,
              rounds: int | None = None, bindings=None,
              progress: Callable[[str, int, int], None] | None = None) -> Calibration:
    """Sample, measure, split, fit and report (see the module note). `bindings` (a ShapeBindings
    from --input-shape/--dim) binds the dynamic dims of every model."""
    from fusesearch.api import for_device
    from fusesearch.pipeline import prepare

    backend = get_backend(backend)
    if samples < 4:
        raise BadInput(f"--samples {samples}: give at least 4 (a few hundred for a useful fit)")
    spec, start = resolve_calibration_device(backend, device)
    names = list(models or DEFAULT_MODELS[backend.name])
    preps = {}
    for name in names:
        source = name if (name.startswith("zoo:") or name.endswith(".onnx")) else f"zoo:{name}"
        preps[name] = for_device(prepare(source, bindings), spec, start)[0]  # TF32 where the device has it
    sample = sample_candidates(preps, spec, start, samples, seed)
    total = len(sample.candidates) * (ROUNDS[backend.name] if rounds is None else rounds)
    if progress:
        progress("sampled", 0, total)
    done = [0]

    def step(_: Candidate) -> None:
        done[0] += 1
        if progress:
            progress("measuring", done[0], total)

    rows, skipped = measure_candidates(sample.candidates, preps, backend, spec, start, seed=seed,
                                       budget_s=budget_s, progress=step, rounds=rounds)
    extra = {"backend": backend.name, "device": spec.name, "models": names, "samples_requested": samples,
             "sampled": len(sample.candidates), "measured": len(rows), "skipped": skipped,
             "sampling": dict(sample.counts),
             "budget_s": BUDGET_S[backend.name] if budget_s is None else budget_s,
             "rounds": ROUNDS[backend.name] if rounds is None else rounds,
             "statistic": "least of the rounds' medians", "threads": spec.sm_count if spec.kind == "cpu" else None}
    return analyse(rows, spec, start, backend.name, seed, extra=extra)


# -- outputs ----------------------------------------------------------------------------------

def plot(frame, path: str | Path) -> Path:
    """Predicted vs measured, log-log, before and after fitting (held-out filled, train hollow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"pointwise": "tab:blue", "rowwise": "tab:orange", "gemm": "tab:green", "conv": "tab:red",
              "conv_disjoint": "tab:brown", "depthwise": "tab:purple"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), sharex=True, sharey=True)
    lo = float(min(frame["measured_s"].min(), frame["predicted_before_s"].min(),
                   frame["predicted_after_s"].min())) * 1e6 / 2
    hi = float(max(frame["measured_s"].max(), frame["predicted_before_s"].max(),
                   frame["predicted_after_s"].max())) * 1e6 * 2
    for ax, col, title in ((axes[0], "predicted_before_s", "before fitting"),
                           (axes[1], "predicted_after_s", "after fitting")):
        for t, color in colors.items():
            for split, face in (("train", "none"), ("heldout", color)):
                sub = frame[(frame["template"] == t) & (frame["split"] == split)]
                if len(sub):
                    ax.scatter(sub["measured_s"] * 1e6, sub[col] * 1e6, s=16, edgecolors=color,
                               facecolors=face, label=f"{t} ({split})")
        ax.plot([lo, hi], [lo, hi], color="gray", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("measured (us)")
        ax.set_title(title)
    axes[0].set_ylabel("predicted (us)")
    axes[1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_outputs(cal: Calibration, profile_path: str | Path) -> dict[str, Path]:
    """profile.json, and measurements.parquet and calibration.png next to it."""
    from costmodels import save_profile

    profile_path = Path(profile_path)
    folder = profile_path.parent
    paths = {"profile": save_profile(cal.profile, profile_path),
             "measurements": folder / "measurements.parquet", "plot": folder / "calibration.png"}
    cal.frame.to_parquet(paths["measurements"], index=False)
    plot(cal.frame, paths["plot"])
    return paths


def known_device_names() -> list[str]:
    return [*DEVICES, "host"]


def report_lines(report: Mapping) -> list[str]:
    """The held-out report as plain lines (what the CLI prints and docs/calibration.md quotes)."""
    lines = []
    for label, key in (("held-out", "heldout"), ("train", "train")):
        block = report[key]
        n = report["n_heldout"] if key == "heldout" else report["n_train"]
        lines.append(f"{label} ({n} kernels)")
        lines.append(f"  {'template':<13} {'n':>4}  {'MAPE':>15}  {'median APE':>15}  {'error factor':>15}  "
                     f"{'Spearman':>13}  {'Kendall':>13}")
        rows = [("overall", block["before"], block["after"])]
        rows += [(t, v["before"], v["after"]) for t, v in block["per_template"].items()]
        for name, b, a in rows:
            lines.append(f"  {name:<13} {a['n']:>4}  {_pct(b['mape'])} → {_pct(a['mape'])}  "
                         f"{_pct(b['median_ape'])} → {_pct(a['median_ape'])}  "
                         f"{_factor(b.get('error_factor'))} → {_factor(a.get('error_factor'))}  "
                         f"{_num(b['spearman'])} → {_num(a['spearman'])}  "
                         f"{_num(b['kendall'])} → {_num(a['kendall'])}")
        if key == "heldout":
            for t, k in report.get("kept_defaults", {}).items():
                what = "held-out" if k["by"] == "held-out" else "cross-validated (training folds)"
                lines.append(f"  {t:<13} kept defaults: {what} error factor would rise from {k['kept_error']:.3f}x "
                             f"to {k['fitted_error']:.3f}x with fitted parameters")
    regs = report.get("registers")
    if regs:
        b, a = regs["heldout"]["before"], regs["heldout"]["after"]
        pa = regs["params_after"]
        lines.append(f"registers vs ptxas ({regs['arch']}, {b['n']} held-out kernels): MAE "
                     f"{_num(b['mae'], 1)} → {_num(a['mae'], 1)}, MAPE {_pct(b['mape'])} → "
                     f"{_pct(a['mape'])}   (regs_base {pa['regs_base']:.2f}, "
                     f"regs_per_live_value {pa['regs_per_live_value']:.3f})")
    return lines


def _pct(x: float) -> str:
    return f"{'-':>6}" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:5.1f}%"


def _factor(x: float | None) -> str:
    return f"{'-':>6}" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:5.3f}x"


def _num(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return f"{'-':>5}"
    return f"{x:5.{digits}f}"


__all__ = ["Calibration", "Candidate", "FitResult", "accuracy", "analyse", "calibrate",
           "check_profile_for_backend", "fit", "fit_registers", "fit_staged", "free_parameters",
           "keep_start", "kendall", "measure_candidates", "part_of", "plot", "predict", "report_lines",
           "runs_through_library",
           "resolve_calibration_device", "sample_candidates", "spearman", "split_groups",
           "table_name_for_gpu", "write_outputs"]
