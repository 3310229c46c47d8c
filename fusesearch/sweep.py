"""Experiment sweeps: a TOML grid of models × devices × strategies × parameters, run on Dask.

Problem: a sweep runs for hours over many processes or a cluster and must survive a killed worker
or an interrupted run without losing or duplicating a result.
Approach: CONFIG.toml → `SweepConfig` (checked, errors name file, key and fix) → cells, each with a
stable id (sha256 of its parameters, RESULTS_VERSION and a profile's content); cells with an ok
OUT/cells/<id>.json are skipped; the rest run on dask.distributed, one task a cell; each result is
written atomically, and OUT/results.parquet rebuilt from the cell files. With a `backend`, cells
also measure ("kernels", and on the cpu "end_to_end" via `run.run_plan`); `costs` picks predicted,
measured or hybrid pricing (`autotune`). Cells are restored from results.parquet when cells/ is
missing; time limit and seed are dropped for strategies other than cpsat. A models entry's
`buckets = { seq = "16..512" }` (a list: an axis) plans every value in one cell (`buckets`). Failing
cells are recorded (`status = "error"`) and retried; another config's results need `force`.
Invariants: a cell file is complete or absent; one row per cell; rows deterministic apart from wall
times, timestamps, worker and time-limited cpsat cells; only `run_sweep` imports dask."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import itertools
import json
import logging
import math
import os
import shutil
import socket
import tempfile
import time
import tomllib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fusesearch import values
from fusesearch.backends.registry import backend_names, get_backend
from fusesearch.buckets import Buckets, Spelling, split_dims
from fusesearch.errors import BadInput, FusesearchError, check_not_read, writing

log = logging.getLogger(__name__)

SCHEMA = "fusesearch.sweep/1"
CELLS_DIR = "cells"
RESULTS = "results.parquet"
MANIFEST = "sweep.json"
LOCK = ".lock"  # held (flock) by the sweep writing the folder
STRATEGIES = ("none", "rules", "greedy", "cpsat")
PARAM_DEFAULTS = {"max_group_size": 16, "time_limit_s": 30.0, "seed": 0, "decompose": "auto"}
CPSAT_ONLY = ("time_limit_s", "seed", "decompose")
TOP_KEYS = {"name", "models", "devices", "strategies", "params", "backend", "measure_budget_s",
            "solver_workers", "measure", "threads", "repeat", "costs"}
MEASURES = ("kernels", "end_to_end")  # what a sweep with a backend times: each kernel alone, the whole plan
MODEL_KEYS = {"model", "label", "input_shapes", "dims", "zoo", "buckets", "bucket_weights"}
PREPARED_CACHE = 2  # prepared models kept per worker process (a 48-layer BERT is ~1.5 GB)


# -- 1. the config ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSpec:
    """One model of the grid: a zoo name or a path, its shapes, and zoo builder parameters."""

    model: str  # as written: zoo:NAME or a path relative to the config file
    label: str
    path: str | None  # resolved path of a file model
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    dims: tuple[tuple[str, int], ...] = ()
    zoo: tuple[tuple[str, int], ...] = ()
    entry: int = 0  # its index in the config's models list (for messages)
    buckets: Buckets | None = None  # one dim over several values, planned together (`buckets`)

    def key(self) -> dict:
        return {"model": self.model, "input_shapes": {k: list(v) for k, v in self.input_shapes},
                "dims": dict(self.dims), "zoo": dict(self.zoo),
                **({"buckets": self.buckets.to_dict()} if self.buckets else {})}

    def bindings(self, value: int | None = None):
        """Its shapes as ShapeBindings whose messages name this config's keys, not CLI flags; `value`:
        its buckets' dim bound to it."""
        from fusesearch.ir.shapes import ShapeBindings, Spelling

        at = f"models[{self.entry}]"
        spelling = Spelling(shape_key=f"{at}.input_shapes.{{name}}",
                            shape_fix=f"input_shapes = {{{{ {{name}} = [D1, D2, ...] }}}} in {at}",
                            dim_key=f"{at}.dims.{{name}}", dim_fix=f"dims = {{{{ {{name}} = V }}}} in {at}",
                            both=f"input_shapes and dims of {at}")
        dims = {**dict(self.dims), **({self.buckets.dim: value} if value is not None else {})}
        return ShapeBindings(MappingProxyType(dict(self.input_shapes)), MappingProxyType(dims), spelling=spelling)

    def shapes_text(self) -> str:
        parts = [f"{k}={'x'.join(map(str, v))}" for k, v in self.input_shapes]
        ranged = [f"{self.buckets.dim}={','.join(map(str, self.buckets.values))}"] if self.buckets else []
        return " ".join(parts + [f"{k}={v}" for k, v in self.dims] + ranged)


@dataclass(frozen=True)
class SweepConfig:
    name: str
    source: str
    models: tuple[ModelSpec, ...]
    devices: tuple[str, ...]  # names, or resolved profile paths
    device_labels: tuple[str, ...]  # as written
    strategies: tuple[str, ...]
    params: Mapping[str, tuple]  # max_group_size, time_limit_s, seed, decompose → values
    solver_workers: int = 1
    backend: str | None = None
    measure_budget_s: float = 0.05
    measure: tuple[str, ...] = ()  # with a backend: "kernels" and/or "end_to_end"
    threads: int = 1  # a CPU device's OpenMP threads: what its plans are priced for, what they run with
    repeat: int = 20  # end_to_end: timed runs of each program
    costs: str = "predicted"  # what prices the groups' choices (`autotune.COSTS`)

    def normalized(self) -> dict:
        """What defines the sweep's results (its identity in OUT/sweep.json)."""
        timed = "end_to_end" in self.measure
        return {"name": self.name, "models": [m.key() for m in self.models],
                "devices": list(self.device_labels), "strategies": list(self.strategies),
                "params": {k: list(v) for k, v in sorted(self.params.items())},
                "solver_workers": self.solver_workers, "backend": self.backend,
                "measure_budget_s": self.measure_budget_s if "kernels" in self.measure else None,
                "measure": list(self.measure) or None,
                "threads": self.threads if timed or any(map(_on_cpu, self.devices)) else None,
                "repeat": self.repeat if timed else None,
                **({"costs": self.costs} if self.costs != "predicted" else {})}

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(sweep_identity(self.normalized()), sort_keys=True).encode()).hexdigest()

    def reads(self) -> list[tuple[str, str]]:
        """(path, what) of the files the sweep reads: the config, model files, device profiles."""
        models = [(m.path, f"model of models[{m.entry}]") for m in self.models if m.path]
        profiles = [(d, "device profile") for d in self.devices if os.path.isfile(d)]
        return [(self.source, "sweep config"), *models, *profiles]


def load_config(path: str | Path) -> SweepConfig:
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{path}: no such sweep config; give a .toml file (see experiments/*.toml)")
    try:
        doc = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: not valid TOML ({exc}); fix the syntax") from None
    return parse_config(doc, path)


def parse_config(doc: Mapping[str, Any], path: Path) -> SweepConfig:
    where = str(path)
    unknown = sorted(set(doc) - TOP_KEYS)
    if unknown:
        raise BadInput(f"{where}: unknown key '{unknown[0]}'; allowed: {', '.join(sorted(TOP_KEYS))}")
    base = path.resolve().parent
    models = _models(doc.get("models"), where, base)
    devices, labels = _devices(doc.get("devices"), where, base)
    strategies = _strings(doc.get("strategies", list(STRATEGIES)), where, "strategies", STRATEGIES)
    params = _params(doc.get("params", {}), where)
    backend = doc.get("backend")
    if backend is not None:
        backend = get_backend(backend, named=f"{where}: backend = {backend!r}", optional=True).name
    budget = _number(doc.get("measure_budget_s", 0.05), where, "measure_budget_s", float, values.seconds)
    workers = _number(doc.get("solver_workers", 1), where, "solver_workers", int, values.cpus)
    measure = _measure_keys(doc, backend, where)
    threads = _number(doc.get("threads", 1), where, "threads", int, values.cpus)
    repeat = _number(doc.get("repeat", 20), where, "repeat", int)
    from fusesearch.autotune import check_costs

    costs = doc.get("costs", "predicted")
    check_costs(costs if isinstance(costs, str) else repr(costs), named=f"{where}: costs =")
    name = doc.get("name", path.stem)
    if not isinstance(name, str) or not name:
        raise BadInput(f"{where}: name must be a non-empty string")
    _check_bindings(models, where)
    _check_buckets(models, where, backend, costs)
    return SweepConfig(name, str(path), models, devices, labels, strategies, params, workers, backend, budget,
                       measure, threads, repeat, costs)


def sweep_identity(normalized: Mapping) -> dict:
    """What a manifest's config means, with every setting at its default left out: a config written
    before a setting existed (no `decompose`, no `costs`) and one that spells the default are the
    same sweep, so an unchanged TOML keeps its results across upgrades that add settings."""
    params = {k: list(v) for k, v in normalized.get("params", {}).items() if list(v) != [PARAM_DEFAULTS.get(k)]}
    models = [{k: v for k, v in m.items() if v not in ({}, None)} for m in normalized.get("models", [])]
    rest = {k: v for k, v in normalized.items() if k not in ("params", "models") and v is not None}
    if rest.get("costs") == "predicted":
        del rest["costs"]
    return {**rest, "models": models, "params": params}


def _check_buckets(models: tuple[ModelSpec, ...], where: str, backend: str | None, costs) -> None:
    """A models entry with buckets is planned over them with predicted costs (as `plan --dim`):
    what that cannot do is refused here, naming the keys."""
    ranged = next((m for m in models if m.buckets), None)
    if ranged is None:
        return
    given = [k for k, on in ((f"backend = {backend!r}", backend), (f"costs = {costs!r}", costs != "predicted")) if on]
    if given:
        raise BadInput(f"{where}: models[{ranged.entry}].buckets with {given[0]}: a sweep over buckets plans with "
                       f"predicted costs only; remove {given[0].split(' =')[0]}, or bind "
                       f"{ranged.buckets.dim} with one value in dims")


def _bucket_sets(entry: dict, where: str) -> list[Buckets | None]:
    """A models entry's `buckets = { DIM = "LO..HI" }` (or a list of such ranges and value lists:
    an axis, one model per item) with `bucket_weights = { DIM = [W1, ...] }`; [None] without."""
    raw, weights = entry.get("buckets"), entry.get("bucket_weights")
    example = 'buckets = { seq = "16..512" } or buckets = { seq = ["16..512", "32,128,512"] }'
    if raw is None:
        if weights is not None:
            raise BadInput(f"{where}: bucket_weights without buckets; add {example}, or remove bucket_weights")
        return [None]
    specs = next(iter(raw.values())) if isinstance(raw, dict) and len(raw) == 1 else None
    specs = specs if isinstance(specs, list) else [specs]
    if not all(isinstance(x, str) for x in specs) or not specs:
        raise BadInput(f"{where}: buckets = {raw!r}; give a table of one dim: {example}")
    name = next(iter(raw))
    if name in entry.get("dims", {}):
        raise BadInput(f"{where}: dims.{name} and buckets.{name} both bind {name}; give it one value in dims "
                       f"or several in buckets")
    if weights is not None and not (isinstance(weights, dict) and set(weights) == {name}
                                    and isinstance(weights[name], list)):
        raise BadInput(f"{where}: bucket_weights = {weights!r}; give bucket_weights = {{ {name} = [W1, W2, ...] }}, "
                       f"one weight per value of buckets.{name}")
    flags = [f"{name}={','.join(map(str, weights[name]))}"] if weights is not None else []
    spelling = Spelling(dim="buckets.{name}", dim_value='buckets.{name} = "{value}"',
                        weights="bucket_weights.{name}", weights_value="bucket_weights.{name} = [{value}]")
    out = []
    for spec in specs:
        try:
            _, buckets = split_dims([f"{name}={spec}"], flags, spelling)
        except BadInput as exc:
            raise BadInput(f"{where}: {exc}") from None
        if buckets is None:
            raise BadInput(f'{where}: buckets.{name} = "{spec}" is one value; give a range "LO..HI" or a list '
                           f'"V1,V2,...", or bind it with dims = {{ {name} = {spec} }}')
        out.append(buckets)
    if len({b.values for b in out}) != len(out):
        raise BadInput(f"{where}: buckets.{name} lists the same values twice; list each once")
    return out


def _measure_keys(doc: Mapping[str, Any], backend: str | None, where: str) -> tuple[str, ...]:
    """What the cells time: `measure` as written, else the backend's default; nothing without one."""
    if backend is None:
        given = sorted(k for k in ("measure", "repeat") if k in doc)
        if given:
            raise BadInput(f"{where}: {given[0]} only applies to a sweep that measures; add backend = \"cpu\" "
                           f"or remove {given[0]}")
        return ()
    runs = get_backend(backend)
    if "measure" not in doc:  # each kernel, and the whole plan where the backend runs it end to end
        return MEASURES if runs.end_to_end else ("kernels",)
    measure = _strings(doc["measure"], where, "measure", MEASURES)
    if "end_to_end" in measure and not runs.end_to_end:
        ends = " or ".join(f'backend = "{n}"' for n in backend_names() if get_backend(n).end_to_end)
        raise BadInput(f"{where}: measure = {list(measure)!r}: whole plans run end to end on {ends} "
                       f"only so far; use measure = [\"kernels\"] or {ends}")
    return measure


def _models(raw, where: str, base: Path) -> tuple[ModelSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise BadInput(f"{where}: 'models' is missing or empty; add models = [\"zoo:resnet50\", ...] "
                       "or [[models]] tables with model = \"zoo:NAME\" or a path")
    specs: list[ModelSpec] = []
    for i, entry in enumerate(raw):
        key = f"models[{i}]"
        if isinstance(entry, str):
            entry = {"model": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise BadInput(f"{where}: {key} must be a string or a table with model = \"zoo:NAME\" or a path")
        unknown = sorted(set(entry) - MODEL_KEYS)
        if unknown:
            raise BadInput(f"{where}: {key}: unknown key '{unknown[0]}'; allowed: {', '.join(sorted(MODEL_KEYS))}")
        specs.extend(_model_specs(entry, f"{where}: {key}", base, i))
    labels = [s.label for s in specs]
    dup = next((x for x in labels if labels.count(x) > 1), None)
    if dup:
        raise BadInput(f"{where}: two models are labelled '{dup}'; give each a distinct label = \"...\"")
    return tuple(specs)


def _model_specs(entry: dict, where: str, base: Path, index: int) -> list[ModelSpec]:
    from fusesearch import zoo

    model = entry["model"]
    shapes = _shape_table(entry.get("input_shapes", {}), where)
    dims = _int_table(entry.get("dims", {}), where, "dims")
    grid = entry.get("zoo", {})
    if not isinstance(grid, dict):
        raise BadInput(f"{where}: zoo must be a table of builder parameters, e.g. zoo = {{ layers = [1, 2] }}")
    path = None
    if model.startswith("zoo:"):
        name = model[4:]
        if name not in zoo.ZOO:
            raise BadInput(f"{where}: unknown zoo model '{name}'; available: {', '.join(zoo.ZOO)}")
        accepted = zoo.ZOO[name].params()
        bad = sorted(set(grid) - set(accepted))
        if bad:
            raise BadInput(f"{where}: zoo model '{name}' has no parameter '{bad[0]}'; accepted: "
                           f"{', '.join(accepted) or 'none'}")
    else:
        if grid:
            raise BadInput(f"{where}: zoo = {{...}} only applies to zoo:NAME models, not {model}")
        resolved = (base / model) if not Path(model).is_absolute() else Path(model)
        if not resolved.is_file():
            raise BadInput(f"{where}: model {model}: no such file (relative paths are read from {base}); "
                           "give an .onnx path or zoo:NAME")
        path = str(resolved)
    names = sorted(grid)
    values = [_int_list(grid[k], where, f"zoo.{k}") for k in names]
    out = []
    for combo, buckets in itertools.product(itertools.product(*values), _bucket_sets(entry, where)):
        params = tuple(zip(names, combo, strict=True))
        default = model[4:] if model.startswith("zoo:") else Path(model).stem
        label = entry.get("label", default)
        if not isinstance(label, str) or not label:
            raise BadInput(f"{where}: label must be a non-empty string")
        if params:
            label += "/" + ",".join(f"{k}={v}" for k, v in params)
        if buckets:
            label += f"/{buckets.dim}={','.join(map(str, buckets.values))}"
        out.append(ModelSpec(model, label, path, shapes, dims, params, index, buckets))
    return out


def _check_bindings(models: tuple[ModelSpec, ...], where: str) -> None:
    """Bind each models entry's input_shapes and dims to its model's graph inputs now (the model read
    once, its weights not loaded; a zoo model built at its smallest parameters, as its graph inputs do
    not depend on them), so that a config which cannot make a model static fails here, naming the key,
    instead of in every cell. A zoo model given neither is skipped: its default dims bind its inputs."""
    from fusesearch import zoo
    from fusesearch.errors import ShapeBindingError
    from fusesearch.ir.load import check_bindings

    entries: dict[int, list[ModelSpec]] = {}
    for spec in models:
        entries.setdefault(spec.entry, []).append(spec)
    for index, specs in entries.items():
        spec = specs[0]
        if spec.model.startswith("zoo:") and not (spec.input_shapes or spec.dims or spec.buckets):
            continue
        bindings, proto = spec.bindings(spec.buckets.values[0] if spec.buckets else None), None
        if spec.zoo:
            name = spec.model[4:]
            smallest = {k: min(dict(s.zoo)[k] for s in specs) for k, _ in spec.zoo}
            proto = zoo.build_model(name, **smallest)
            bindings = bindings.with_defaults(zoo.ZOO[name].default_dims)
        try:
            check_bindings(spec.path or spec.model, bindings, proto=proto)
        except ShapeBindingError as exc:
            raise BadInput(f"{where}: {exc}") from None
        except BadInput as exc:
            raise BadInput(f"{where}: models[{index}]: {exc}") from None


def _shape_table(raw, where: str) -> tuple:
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: input_shapes must be a table, e.g. input_shapes = {{ input = [1, 3, 224, 224] }}")
    return tuple(sorted((k, tuple(_int_list(v, where, f"input_shapes.{k}"))) for k, v in raw.items()))


def _int_table(raw, where: str, key: str) -> tuple:
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: {key} must be a table, e.g. {key} = {{ batch = 1 }}")
    out = []
    for k, v in sorted(raw.items()):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise BadInput(f"{where}: {key}.{k} = {v!r}; give a positive integer")
        out.append((k, v))
    return tuple(out)


def _int_list(raw, where: str, key: str) -> list[int]:
    values = raw if isinstance(raw, list) else [raw]
    if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
        raise BadInput(f"{where}: {key} = {raw!r}; give a positive integer or a list of them")
    return values


def _devices(raw, where: str, base: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    from costmodels import CostModelError, load_device

    if not isinstance(raw, list) or not raw or not all(isinstance(d, str) and d for d in raw):
        raise BadInput(f"{where}: 'devices' is missing or not a list of names; add devices = [\"t4\", "
                       "\"h100-sxm\"] (see `fusesearch devices`) or profile.json paths")
    resolved = []
    for d in raw:
        target = str(base / d) if d.endswith(".json") and not Path(d).is_absolute() else d
        try:
            load_device(target)
        except CostModelError as exc:
            raise BadInput(f"{where}: devices: {d}: {exc}") from None
        resolved.append(target)
    if len(set(raw)) != len(raw):
        raise BadInput(f"{where}: devices lists a device twice; list each once")
    return tuple(resolved), tuple(raw)


def _strings(raw, where: str, key: str, allowed: Iterable[str]) -> tuple[str, ...]:
    allowed = tuple(allowed)
    if not isinstance(raw, list) or not raw or any(s not in allowed for s in raw):
        raise BadInput(f"{where}: {key} = {raw!r}; give a list drawn from {', '.join(allowed)}")
    if len(set(raw)) != len(raw):
        raise BadInput(f"{where}: {key} lists a value twice; list each once")
    return tuple(raw)


PARAM_RULES = {"max_group_size": values.count, "time_limit_s": values.seconds, "seed": values.seed}


def _params(raw, where: str) -> dict[str, tuple]:
    """The [params] lists, each value checked by the rule its CLI option has (`fusesearch.values`)."""
    from fusesearch.search.problem import check_decompose

    if not isinstance(raw, dict):
        raise BadInput(f"{where}: [params] must be a table of {', '.join(PARAM_DEFAULTS)}")
    unknown = sorted(set(raw) - set(PARAM_DEFAULTS))
    if unknown:
        raise BadInput(f"{where}: params.{unknown[0]}: unknown; allowed: {', '.join(PARAM_DEFAULTS)}")
    out = {}
    for key, default in PARAM_DEFAULTS.items():
        given = raw.get(key, default)
        kind = float if key == "time_limit_s" else int
        checked = [check_decompose(v, f"{where}: params.{key} =") if key == "decompose" else
                   _number(v, where, f"params.{key}", kind, PARAM_RULES[key])
                   for v in (given if isinstance(given, list) else [given])]
        if not checked or len(set(checked)) != len(checked):
            raise BadInput(f"{where}: params.{key}: give at least one value, each once")
        out[key] = tuple(checked)
    return out


def _number(value, where: str, key: str, kind, rule=values.count):
    """VALUE of KEY as `kind` (an int never from a float), or a BadInput naming the file and key."""
    typed = isinstance(value, int | float) and not isinstance(value, bool) and (
        kind is float or isinstance(value, int))
    problem = rule(value) if typed else f"{'an integer' if kind is int else 'a number'}"
    if problem:
        raise BadInput(f"{where}: {key} = {value!r}; give {problem}")
    return kind(value)


# -- 2. the grid ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    index: int
    cell_id: str
    sweep: str
    model: ModelSpec
    device: str  # as loaded (name or resolved profile path)
    device_label: str
    strategy: str
    max_group_size: int
    time_limit_s: float | None
    seed: int | None
    solver_workers: int
    backend: str | None
    measure_budget_s: float | None
    measure: tuple[str, ...] = ()
    threads: int | None = None
    repeat: int | None = None
    costs: str = "predicted"
    decompose: str | None = None  # cpsat's (`search.problem.DECOMPOSE`)

    def params(self) -> dict:
        """What decides the cell's result; `costs` only where not predicted and `decompose` only
        where not auto (so the cells of a sweep that sets neither keep their ids)."""
        return {**({"costs": self.costs} if self.costs != "predicted" else {}),
                **({"decompose": self.decompose} if self.decompose not in (None, "auto") else {}),"model": self.model.key(), "device": self.device_label, "strategy": self.strategy,
                "max_group_size": self.max_group_size, "time_limit_s": self.time_limit_s,
                "seed": self.seed, "solver_workers": self.solver_workers if self.strategy == "cpsat" else None,
                "backend": self.backend, "measure_budget_s": self.measure_budget_s,
                "measure": list(self.measure) or None, "threads": self.threads, "repeat": self.repeat}


# Bumped whenever a change makes the same cell give other figures (the cost model's prices, the
# generated kernels), so a rerun after it recomputes every cell instead of keeping stale rows.
# 2: lone anchors priced as library calls on tensor cores, generated kernels on the units they use.
# 3: the direct skeleton priced as a thread per output; row kernels' grids and cached-row shared
#    memory; a cpu sweep runs each plan end to end beside ONNX Runtime (the end_to_end_* columns).
# 4: fused gemm/conv groups generated for TF32/FP16/BF16 tensor cores and priced there (mma_efficiency).
# 5: a fused gemm/conv group's unit (tensor or CUDA cores) priced per device, the faster kept; the
#    tensor-core skeletons refused before sm_80.
# 6: cpsat keeps the quotient acyclic by cycle cuts and cuts deep graphs into pieces: cells that
#    stopped at their limit prove their optimum; a proven optimum's plan is the one-worker re-solve's.
RESULTS_VERSION = 6


def cell_id(params: Mapping[str, Any], device: str = "") -> str:
    """A hash of what decides the cell's result: its parameters, RESULTS_VERSION, and a device
    profile's content (not its path: a profile recalibrated in place gives new cells)."""
    keyed = {**params, "results_version": RESULTS_VERSION, "device_content": _content_digest(device)}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]


def _content_digest(device: str) -> str:
    """sha256 of a profile file's bytes; a built-in device name stands for itself."""
    path = Path(device)
    if device.endswith(".json") and path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    return device


def _on_cpu(device: str) -> bool:
    """Whether a cell's device is a CPU (host, or a host profile): its plans are priced for the
    sweep's threads."""
    from costmodels import load_profile
    from costmodels.devices import HOST_NAMES

    if device.strip().lower() in HOST_NAMES:
        return True
    return device.endswith(".json") and Path(device).is_file() and load_profile(device).device.kind == "cpu"


def expand(config: SweepConfig) -> list[Cell]:
    """Every distinct cell, in grid order (model, device, strategy, group size, time limit, seed,
    decompose)."""
    cells: list[Cell] = []
    seen: set[str] = set()
    p = config.params
    for model, (device, label), strategy, size, limit, seed, decompose in itertools.product(
            config.models, zip(config.devices, config.device_labels, strict=True), config.strategies,
            p["max_group_size"], p["time_limit_s"], p["seed"], p["decompose"]):
        exact = strategy == "cpsat"
        timed = "end_to_end" in config.measure
        cell = Cell(0, "", config.name, model, device, label, strategy, size, limit if exact else None,
                    seed if exact else None, config.solver_workers, config.backend,
                    config.measure_budget_s if "kernels" in config.measure else None, config.measure,
                    config.threads if timed or _on_cpu(device) else None, config.repeat if timed else None,
                    config.costs, decompose if exact else None)
        cid = cell_id(cell.params(), device)
        if cid in seen:
            continue
        seen.add(cid)
        cells.append(dataclasses.replace(cell, index=len(cells), cell_id=cid))
    return cells


# -- 3. one cell (runs on a worker) -------------------------------------------------------------

_PREPARED: OrderedDict[str, Any] = OrderedDict()


def prepared_model(spec: ModelSpec):
    """load → canonicalize → Graph, cached per (model, shapes, zoo parameters) in this process."""
    key = json.dumps(spec.key(), sort_keys=True)
    if key in _PREPARED:
        _PREPARED.move_to_end(key)
        return _PREPARED[key], 0.0
    start = time.perf_counter()
    prep = _prepare(spec)
    _PREPARED[key] = prep
    while len(_PREPARED) > PREPARED_CACHE:
        _PREPARED.popitem(last=False)
    return prep, time.perf_counter() - start


def _prepare(spec: ModelSpec):
    """The prepared model; with buckets, a list of them, one per value in order."""
    from fusesearch import zoo
    from fusesearch.pipeline import prepare

    at = spec.buckets.values if spec.buckets else (None,)
    if not spec.zoo:
        preps = [prepare(spec.path or spec.model, spec.bindings(v)) for v in at]
        return preps if spec.buckets else preps[0]
    name = spec.model[4:]
    proto = zoo.build_model(name, **dict(spec.zoo))
    with tempfile.TemporaryDirectory(prefix="fusesearch-sweep-") as tmp:
        path = Path(tmp) / f"{name}.onnx"
        path.write_bytes(proto.SerializeToString())
        del proto
        preps = [prepare(str(path), spec.bindings(v).with_defaults(zoo.ZOO[name].default_dims)) for v in at]
        return preps if spec.buckets else preps[0]


def run_cell(cell: Cell) -> dict:
    """The row of one cell; an exception becomes status 'error' with its text (never raised)."""
    start = time.perf_counter()
    row = base_row(cell)
    try:
        row.update(_plan_row(cell))
        row["status"] = "ok"
    except Exception as exc:  # a failed cell is a result, not a crash of the sweep
        log.warning("cell %s (%s) failed: %s", cell.cell_id, cell.model.label, exc)
        row.update(status="error", error=error_text(exc))
    row["cell_wall_s"] = round(time.perf_counter() - start, 3)
    row["worker"] = f"{socket.gethostname()}:{os.getpid()}"
    return row


def error_text(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:500]


def base_row(cell: Cell) -> dict:
    m = cell.model
    return {"cell_id": cell.cell_id, "cell_index": cell.index, "sweep": cell.sweep, "model": m.label,
            "model_source": m.model, "shapes": m.shapes_text(), "zoo_params": json.dumps(dict(m.zoo)),
            "device": cell.device_label, "strategy": cell.strategy, "max_group_size": cell.max_group_size,
            "time_limit_s": cell.time_limit_s, "seed": cell.seed,
            "solver_workers": cell.solver_workers if cell.strategy == "cpsat" else None,
            "backend": cell.backend, "costs": cell.costs, "decompose": cell.decompose, "status": None,
            "error": None,
            "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "git_rev": git_revision(), "versions": json.dumps(package_versions(), sort_keys=True)}


def _plan_row(cell: Cell) -> dict:
    from fusesearch.api import plan as api_plan

    prep, prepare_s = prepared_model(cell.model)
    if cell.model.buckets:
        return _bucket_row(cell, prep, prepare_s)
    kwargs = {"max_group_size": cell.max_group_size, "seed": cell.seed or 0, "prepared": prep,
              "workers": cell.solver_workers, "costs": cell.costs, "threads": cell.threads or 1}
    if cell.time_limit_s is not None:
        kwargs["time_limit_s"] = cell.time_limit_s
    if cell.decompose is not None:
        kwargs["decompose"] = cell.decompose
    p = api_plan(cell.model.model, cell.device, cell.strategy, **kwargs)
    row = _plan_columns(p, prepare_s)
    if cell.backend:
        row.update(_measure(cell, prep, p))
    return row


def _bucket_row(cell: Cell, preps: list, prepare_s: float) -> dict:
    """One plan over the cell's buckets (`buckets.plan_buckets`): the plan's columns (its times the
    weighted sums over the buckets), then each bucket's figures beside its own optimal plan and
    how the own plans change between neighbouring buckets (`bucket_figures`, `bucket_changes`)."""
    from fusesearch.buckets import changes_dict, plan_buckets
    from fusesearch.search import SearchConfig

    buckets = cell.model.buckets
    config = SearchConfig(time_limit_s=cell.time_limit_s or PARAM_DEFAULTS["time_limit_s"], seed=cell.seed or 0,
                          workers=cell.solver_workers, max_group_size=cell.max_group_size)
    p, figures, _ = plan_buckets(preps, buckets, cell.device, cell.strategy, config, cell.threads or 1)
    worst = max(figures, key=lambda f: f.price)
    return {**_plan_columns(p, prepare_s), "bucket_dim": buckets.dim, "bucket_values": json.dumps(buckets.values),
            "bucket_figures": json.dumps([f.to_dict() for f in figures]),
            "bucket_changes": json.dumps(changes_dict(figures)["changes"]),
            "worst_bucket": worst.value, "worst_bucket_price": worst.price}


def _plan_columns(p, prepare_s: float) -> dict:
    """A plan's figures as a row's columns."""
    s = p.solver
    stats = dict(s.stats)
    row = {"nodes": p.model.nodes, "canonical_nodes": p.model.canonical_nodes, "kernels": p.kernels,
           "fused_kernels": sum(len(g.nodes) > 1 for g in p.groups),
           "time_s": p.time_s, "unfused_time_s": p.unfused_time_s, "lower_bound_s": p.lower_bound_s,
           "speedup": p.speedup, "x_lower_bound": p.time_s / p.lower_bound_s if p.lower_bound_s else math.nan,
           "dram_bytes": p.dram_bytes, "flops": p.flops,
           "solver_status": s.status, "objective_s": s.objective_s, "bound_s": s.bound_s,
           "gap": s.gap if s.bound_s is not None else None,
           "candidates": stats.get("candidates"), "enumeration_s": stats.get("enumeration_s"),
           "solve_s": stats.get("solver_wall_s"), "wall_s": round(s.wall_s, 3),
           "pieces": stats.get("decomposition", {}).get("pieces"),
           "distinct": stats.get("decomposition", {}).get("distinct"),
           "prepare_s": round(prepare_s, 3), "fallback": stats.get("fallback"),
           "templates": json.dumps(_count(g.kernel.template if not g.kernel.alias else "alias" for g in p.groups)),
           "bounds": json.dumps(_count(g.cost.bound for g in p.groups if not g.kernel.alias)),
           "bound_time_s": json.dumps(_sum_by(p.groups, lambda g: g.cost.bound)),
           "template_time_s": json.dumps(_sum_by(p.groups, lambda g: "alias" if g.kernel.alias else g.kernel.template)),
           "plan_sha": _plan_sha(p), "fused_groups": json.dumps(_fused_groups(p)),
           "measured_groups": sum(g.source == "measured" for g in p.groups)}
    return row


def _count(items: Iterable[str]) -> dict:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return dict(sorted(out.items()))


def _sum_by(groups, key) -> dict:
    out: dict[str, float] = {}
    for g in groups:
        out[key(g)] = out.get(key(g), 0.0) + g.cost.time_s
    return {k: float(f"{v:.6g}") for k, v in sorted(out.items())}


def _fused_groups(p) -> list[str]:
    return sorted("+".join(p.graph.nodes[v].name for v in g.nodes) for g in p.groups if len(g.nodes) > 1)


def _plan_sha(p) -> str:
    groups = sorted(sorted(p.graph.nodes[v].name for v in g.nodes) for g in p.groups)
    return hashlib.sha256(json.dumps(groups).encode()).hexdigest()[:16]


def _measure(cell: Cell, prep, p) -> dict:
    """The plan measured on the cell's backend against the unfused graph (strategy none): each
    kernel alone ("kernels": measured_s, the sum) and the whole plan as one program beside ONNX
    Runtime ("end_to_end": `RunReport.columns`, end_to_end_*)."""
    from fusesearch.api import plan as api_plan
    from fusesearch.backends.cpu import openmp_threads
    from fusesearch.backends.timing import TimingCache
    from fusesearch.measure import measure_plan
    from fusesearch.run import run_plan

    backend = get_backend(cell.backend)
    threads = cell.threads or 1
    unfused = api_plan(cell.model.model, cell.device, "none", prepared=prep, threads=threads)
    row: dict = {"measured_on": backend.device_label()}
    if "kernels" in cell.measure:  # against the unfused graph as ONNX Runtime runs it node by node
        library = api_plan(cell.model.model, cell.device, "none", prepared=prep, lone_anchors="library",
                           threads=threads)
        with openmp_threads(0 if backend.cuda else threads):
            report = measure_plan(prep, p, library, backend, budget_s=cell.measure_budget_s or 0.05,
                                  seed=cell.seed or 0, cache=TimingCache())
        t = report.totals()
        row.update({"measured_s": t["measured_s"], "unfused_measured_s": t["unfused_measured_s"],
                    "measured_speedup": t["speedup"], "not_measured": t["not_measured"]})
    if "end_to_end" in cell.measure:
        row.update(run_plan(prep, p, unfused, threads=threads, repeat=cell.repeat or 20,
                            seed=cell.seed or 0, backend=backend).columns())
    return row


_VERSIONS: dict | None = None


def package_versions() -> dict:
    global _VERSIONS
    if _VERSIONS is None:
        import platform

        from costmodels.profile import installed_versions

        _VERSIONS = {"python": platform.python_version(), **installed_versions(
            ("fusesearch", "onnx", "onnx-ir", "onnxruntime", "ortools", "numpy", "dask", "distributed"))}
    return _VERSIONS


def git_revision() -> str | None:
    """HEAD's commit of the checkout this package runs from (read from .git, no git process)."""
    here = Path(__file__).resolve().parent
    for root in (here, *here.parents):
        git = root / ".git"
        if git.is_file():  # a worktree: "gitdir: PATH"
            text = git.read_text().strip()
            git = (root / text.removeprefix("gitdir:").strip()).resolve()
        if git.is_dir():
            return _read_head(git)
    return None


def _read_head(git: Path) -> str | None:
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head
        ref = head[4:].strip()
        common = git / "commondir"
        bases = [git] + ([(git / common.read_text().strip()).resolve()] if common.is_file() else [])
        for base in bases:
            if (base / ref).is_file():
                return (base / ref).read_text().strip()
            packed = base / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0]
    except OSError:
        return None
    return None


# -- 4. the results folder --------------------------------------------------------------------

@dataclass
class SweepStore:
    """OUT/: sweep.json (the config's identity), config.toml, cells/<id>.json, results.parquet."""

    out: Path
    finished: dict[str, dict] = field(default_factory=dict)

    @property
    def cells_dir(self) -> Path:
        return self.out / CELLS_DIR

    def open(self, config: SweepConfig, *, force: bool = False, cells: Sequence[Cell] = ()) -> None:
        """Check OUT holds this sweep (or nothing), write its manifest with the grid's cell ids (a
        cell file of an earlier grid, from before a profile was recalibrated or RESULTS_VERSION
        moved, stays on disk but is no longer one of this sweep's results), load the cells done."""
        manifest = self.out / MANIFEST
        try:
            old = read_manifest(self.out)
        except BadInput:
            if not force:
                raise
            old = {}  # unreadable: discarded as a different sweep's
        if old is not None:
            if sweep_identity(old.get("config") or {}) != sweep_identity(config.normalized()):
                if not force:
                    raise BadInput(f"--out {self.out}: holds the results of a different sweep "
                                   f"('{old.get('name')}' from {old.get('source')}); give another --out, "
                                   "or pass --force to discard those results")
                self.discard()
        elif self.cells_dir.is_dir() and any(self.cells_dir.glob("*.json")) and not force:
            raise BadInput(f"--out {self.out}: holds cell results without a {MANIFEST}; give another --out, "
                           "or pass --force to discard them")
        elif force:
            self.discard()
        self.cells_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.cells_dir.glob(".*.tmp"):  # a write cut short by a crash: the cell reruns
            stale.unlink(missing_ok=True)
        _atomic_write(manifest, json.dumps({"schema": SCHEMA, "name": config.name, "source": config.source,
                                            "config_sha256": config.sha256(), "config": config.normalized(),
                                            "cell_ids": [c.cell_id for c in cells]},
                                           indent=1) + "\n")
        if Path(config.source).is_file():
            _atomic_write(self.out / "config.toml", Path(config.source).read_text())
        self.finished = {row["cell_id"]: row for row in read_cells(self.out)}
        if not self.finished and (self.out / RESULTS).is_file():  # a committed results.parquet, no cells
            for row in _parquet_rows(self.out / RESULTS):
                self.write(row)

    @contextmanager
    def locked(self):
        """Hold OUT for this process while the sweep runs: a second sweep into OUT (the same
        grid would compute every cell twice; another would discard this one's results) is
        refused at once, naming the folder, rather than left waiting for hours."""
        import fcntl

        if self.out.exists() and not self.out.is_dir():
            raise BadInput(f"--out {self.out}: is a file; give a folder for the sweep's results")
        with writing(self.out, "--out"):
            self.out.mkdir(parents=True, exist_ok=True)
            handle = open(self.out / LOCK, "a+")
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise BadInput(f"--out {self.out}: is in use by another sweep running now; wait for it to "
                               "finish (then run this one again to add what it lacks), or give another --out") from None
            try:
                yield self
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def writes(self) -> list[tuple[Path, str]]:
        """(path, flag) of what the sweep writes or may discard in OUT (any file in its cells folder)."""
        cells = sorted(self.cells_dir.iterdir()) if self.cells_dir.is_dir() else []
        return [(self.out / name, "--out") for name in (MANIFEST, RESULTS, "config.toml")] + [
            (path, "--out") for path in cells]

    def discard(self) -> None:
        for name in (MANIFEST, RESULTS, "config.toml"):
            (self.out / name).unlink(missing_ok=True)
        if self.cells_dir.is_dir():
            shutil.rmtree(self.cells_dir)

    def done(self, cid: str) -> bool:
        row = self.finished.get(cid)
        return row is not None and row.get("status") == "ok"

    def write(self, row: dict) -> None:
        _atomic_write(self.cells_dir / f"{row['cell_id']}.json", json.dumps(row, sort_keys=True) + "\n")
        self.finished[row["cell_id"]] = row

    def rebuild(self, cells: list[Cell]) -> Path:
        """results.parquet: one row per cell of this grid that has a file, in grid order."""
        import pandas as pd

        ids = {c.cell_id for c in cells}
        rows = [r for r in read_cells(self.out) if r["cell_id"] in ids]
        frame = _frame(rows) if rows else pd.DataFrame({"cell_id": pd.Series(dtype=str)})
        target = self.out / RESULTS
        tmp = target.with_name(f".{RESULTS}.{os.getpid()}.tmp")
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, target)
        return target


def _frame(rows: list[dict]):
    import pandas as pd

    frame = pd.DataFrame(rows).sort_values("cell_index", kind="stable").reset_index(drop=True)
    first = [c for c in ("cell_id", "cell_index", "sweep", "model", "device", "strategy", "max_group_size",
                         "time_limit_s", "seed", "status", "kernels", "time_s", "unfused_time_s",
                         "lower_bound_s", "solver_status", "wall_s", "gap", "measured_s",
                         "end_to_end_plan_median_s", "end_to_end_ort_enable_all_median_s", "error")
             if c in frame.columns]
    return frame[first + [c for c in frame.columns if c not in first]]


def _parquet_rows(path: Path) -> list[dict]:
    """Rows of results.parquet as cell dicts (NaN → None), to restore cells/ from it."""

    frame = _read_parquet(path)
    if "cell_id" not in frame:
        return []
    frame = frame.astype(object).where(frame.notna(), None)
    return [{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
            for row in frame.to_dict("records")]


def _read_parquet(path: Path):
    """results.parquet as a DataFrame, or a BadInput naming it when it cannot be read."""
    import pandas as pd

    try:
        return pd.read_parquet(path)
    except Exception as exc:  # pyarrow's ArrowInvalid, OSError, ...: a damaged or foreign file
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadInput(f"{path}: not a readable results file ({reason}); remove it: `fusesearch sweep` "
                       f"rebuilds it from the cell files in {path.parent / CELLS_DIR} (and runs again the "
                       "cells that have none)") from None


def read_cells(out: Path) -> list[dict]:
    rows = []
    for path in sorted((Path(out) / CELLS_DIR).glob("*.json")):
        try:
            rows.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):  # cannot happen with atomic writes; skip, rerun it
            log.warning("%s: unreadable cell file; the cell will run again", path)
    return rows


def load_results(out: str | Path):
    """The sweep's rows as a DataFrame: from the cell files of the grid sweep.json names (the
    truth), else results.parquet."""

    out = Path(out)
    if not out.is_dir():
        raise BadInput(f"{out}: no such folder; give the --out folder of a `fusesearch sweep` run")
    rows = read_cells(out)
    grid = (read_manifest(out) or {}).get("cell_ids")
    if grid:  # this grid's cells only: files of an earlier grid (another profile's) are not its results
        rows = [r for r in rows if r.get("cell_id") in set(grid)]
    if rows:
        return _frame(rows)
    if (out / RESULTS).is_file():
        return _read_parquet(out / RESULTS)
    raise BadInput(f"{out}: holds no sweep results ({CELLS_DIR}/*.json or {RESULTS}); "
                   "run `fusesearch sweep CONFIG.toml --out DIR` first")


def read_manifest(out: Path) -> dict | None:
    """OUT/sweep.json as a dict, None when there is none; a BadInput naming it when unreadable."""
    path = Path(out) / MANIFEST
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        doc = exc
    if not isinstance(doc, dict):
        reason = doc if isinstance(doc, Exception) else f"a JSON {type(doc).__name__}, not an object"
        raise BadInput(f"{path}: not a readable sweep manifest ({reason}); run the sweep again with --force to "
                       "start this folder afresh, or give another folder")
    return doc


def results_reads(out: Path) -> list[tuple[Path, str]]:
    """What a command reading the results folder OUT reads, for `errors.check_outputs`: its
    manifest, results file and every cell file (the cells folder)."""
    out = Path(out)
    return [(out / MANIFEST, "sweep manifest"), (out / RESULTS, "sweep's results"),
            (out / CELLS_DIR, "sweep's cell files")]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# -- 5. running on dask -----------------------------------------------------------------------

@dataclass(frozen=True)
class SweepSummary:
    out: Path
    cells: int
    skipped: int
    ran: int
    failed: int
    wall_s: float
    results: Path
    first_error: str | None = None  # of the first failed cell in grid order

    @property
    def all_failed(self) -> bool:
        return self.cells > 0 and self.failed == self.cells


def run_sweep(config: SweepConfig, out: str | Path, *, workers: int | None = None,
              scheduler: str | None = None, force: bool = False,
              progress: Callable[[int, int, dict | None], None] | None = None,
              on_client: Callable[[Any], None] | None = None) -> SweepSummary:
    """Run every unfinished cell of `config` on Dask; `progress(done, total, row)` after each.

    `on_client(client)` is called once the cluster is up (tests use it to find worker pids).
    From a script, call it under `if __name__ == "__main__":` (local workers are spawned)."""
    if workers is not None and scheduler is not None:
        raise BadInput("--workers and --scheduler: give one (N local processes, or a scheduler address)")
    if workers is not None and workers < 1:
        raise BadInput(f"--workers {workers}: give a positive number of worker processes")
    if scheduler is not None:
        check_scheduler(scheduler)
    start = time.perf_counter()
    store = SweepStore(Path(out))
    check_not_read(store.writes(), config.reads())
    cells = expand(config)
    with store.locked():
        with writing(store.out, "--out"):
            store.open(config, force=force, cells=cells)
        todo = [c for c in cells if not store.done(c.cell_id)]
        skipped = len(cells) - len(todo)
        failed = 0
        if progress:
            progress(skipped, len(cells), None)
        try:
            if todo:
                failed = _run_on_dask(todo, store, workers, scheduler, skipped, len(cells), progress, on_client)
        finally:
            results = store.rebuild(cells)
    first_error = next((store.finished[c.cell_id].get("error") for c in cells
                        if c.cell_id in store.finished and not store.done(c.cell_id)), None)
    return SweepSummary(store.out, len(cells), skipped, len(todo), failed, time.perf_counter() - start, results,
                        first_error)


SPAWN_ENV = "distributed.nanny.pre-spawn-environ"


def _worker_environ() -> dict:
    """The environment Dask sets in a local worker before it starts, less MALLOC_TRIM_THRESHOLD_:
    Dask sets it to 64 KiB, which turns off glibc's adaptive mmap threshold, so every large
    scratch buffer a generated C kernel allocates is mapped and faulted in afresh on each call
    (resnet18's program ran 1.7x slower under it: 92 ms against 55 ms). Thread counts stay 1;
    a cell sets its own (`threads`)."""
    import dask

    return {k: v for k, v in (dask.config.get(SPAWN_ENV, default=None) or {}).items()
            if k != "MALLOC_TRIM_THRESHOLD_"}


def _run_on_dask(todo: list[Cell], store: SweepStore, workers, scheduler, skipped, total, progress,
                 on_client) -> int:
    try:
        import dask
        from distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise BadInput("fusesearch sweep needs dask.distributed; install the extra: "
                       "pip install 'fusesearch[dist]'") from None
    cluster = None
    try:
        if scheduler:
            client = _connect(Client, scheduler)
        else:
            n = workers or default_workers()
            logging.getLogger("distributed").setLevel(max(logging.WARNING, log.getEffectiveLevel()))
            inherited = os.environ.pop("MALLOC_TRIM_THRESHOLD_", None)  # workers inherit our environment
            try:
                with dask.config.set({SPAWN_ENV: _worker_environ()}):
                    cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                           dashboard_address=":0", silence_logs=logging.WARNING)
            finally:
                if inherited is not None:
                    os.environ["MALLOC_TRIM_THRESHOLD_"] = inherited
            client = Client(cluster)
    except OSError as exc:
        raise FusesearchError(f"could not start the Dask cluster: {exc}") from None
    failed, done = 0, total - len(todo)
    try:
        if on_client:
            on_client(client)
        futures = {client.submit(run_cell, c, key=f"cell-{c.cell_id}", pure=False,
                                 priority=-c.index): c for c in todo}
        for future in as_completed(futures):
            cell = futures[future]
            row = _collect(future, cell)
            store.write(row)
            failed += row["status"] != "ok"
            done += 1
            if progress:
                progress(done, total, row)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    return failed


def check_scheduler(address: str) -> None:
    """A Dask scheduler address must parse as one (scheme://HOST:PORT, a known scheme, a port),
    before the results folder is touched; whether it answers is `_connect`'s to find out."""
    try:
        from distributed.comm import registry
        from distributed.comm.addressing import parse_address, parse_host_port
    except ImportError:
        return  # `_run_on_dask` says how to install it
    try:
        scheme, location = parse_address(address)
        registry.get_backend(scheme)
        if scheme in ("tcp", "tls") and not 0 < parse_host_port(location)[1] < 65536:
            raise ValueError("the port is not from 1 to 65535")
    except ValueError as exc:
        raise BadInput(f"--scheduler {address}: not a scheduler address ({exc}); give one such as "
                       "tcp://HOST:8786") from None


def _connect(client_cls, address: str):
    try:
        return client_cls(address, timeout="20s")
    except (OSError, TimeoutError) as exc:
        raise BadInput(f"--scheduler {address}: cannot reach a Dask scheduler there ({exc}); "
                       "check the address (tcp://HOST:8786) and that the scheduler runs") from None


def _collect(future, cell: Cell) -> dict:
    """The worker's row, or an error row when the task itself failed (e.g. its worker kept dying)."""
    try:
        return future.result()
    except Exception as exc:
        row = base_row(cell)
        row.update(status="error", error=error_text(exc))
        return row


def default_workers() -> int:
    return values.usable_cpus()
