"""Measured costs (`--costs measured|hybrid`): time each candidate group's choices and search over them.

Problem: the cost model ranks a group's choices (our C or the library call, a tile, tensor or
CUDA cores) and the groups themselves, and measured, its order is often not the machine's; the
model cannot be better than its measurements, and nothing measured the alternatives.
Approach: an `Autotuner` is the `rules.Measurer` that `Legality.choose` asks: each choice of a
group runs on the backend of the plan's device (the CPU for `host`, CuPy for a GPU), generated
under one kernel name so that the same kernel in another layer or model is the same source; a
group's choices are sampled in the same rounds (the backend's `sample`: on a GPU per launch from
CUDA-graph replays, L2 flushed), with the backend's null calls among them and taken off as `measure` does (`NullCalls`, `CallCosts.net`), and each
median is kept in the timing database (`TimingCache`, the cache folder) under the kernel's
source hash (a library call: the node's signature), its input shapes, the device and its
threads, so any later plan, run or sweep reads it instead of timing it again. Before a search
the candidates the exact solver enumerates are measured as one batch (`prefetch`: compiled in
parallel, `BATCH` choices per sampling call), and a group a solver reaches later is measured
when it is checked. `hybrid` times only the choices predicted within `band` of the group's best
(the profile's held-out error factor, else DEFAULT_BAND); the rest, and a choice that cannot
run alone (codegen refuses a fused group, no library kernel), keep the predicted cost and say
why (`Verdict.note`, a plan's `cost_note`).

    plan --costs measured:  enumerate (predicted legality) -> prefetch: DB hit or time
                            -> search with Legality(measurer=tuner) -> each group's fastest choice

Invariants: with `predicted` nothing here runs (the plan is the model's, byte for byte); the same
database gives the same plan; a sample is taken through `sampler` (a test passes fixed ones), so
nothing here depends on wall time but `stats.wall_s`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fusesearch.backends.codegen import CodegenRefused, generate
from fusesearch.backends.registry import CPU, CUPY, Backend
from fusesearch.backends.timing import Timing, TimingCache
from fusesearch.errors import BadInput, FusesearchError

COSTS = ("predicted", "measured", "hybrid")
DEFAULT_BAND = 1.5  # hybrid: measure choices predicted within this factor of the group's best
BUDGET_S = 0.01  # seconds of samples per choice, over ROUNDS passes
WARMUP_S = 0.02  # the first pass: long enough to wake an OpenMP pool (0.002 s left 20 ms samples)
ROUNDS = 3
BATCH = 48  # choices sampled in one interleaved call (their buffers and libraries alive together)
KERNEL_NAME = "fs_choice"  # one name for every choice: the same kernel is the same source anywhere


def check_costs(costs: str, named: str = "--costs") -> str:
    """The one check of a `--costs` value (and the sweep file's `costs` key)."""
    if costs not in COSTS:
        raise BadInput(f"{named} {costs}: choose one of {', '.join(COSTS)}")
    return costs


def timing_backend(costs: str, spec) -> Backend | None:
    """The backend that times a device's choices (None for predicted costs): the CPU for a CPU
    device, CuPy for a GPU; BadInput (one line) where it cannot run here."""
    if check_costs(costs) == "predicted":
        return None
    gpu = spec.kind == "gpu"
    backend = CUPY if gpu else CPU
    decision = backend.available()
    if not decision:
        needs = "a GPU with CuPy" if gpu else "a C compiler"
        raise BadInput(f"--costs {costs}: timing the choices for --device {spec.name} needs {needs} here "
                       f"({decision.reason}); use --costs predicted"
                       + (", or --device host to measure on this CPU" if gpu else ""))
    if gpu and backend.cost_device() != spec.name:  # times of another GPU would price this one
        raise BadInput(f"--costs {costs}: the GPU here is {backend.device_label()}, not --device {spec.name}; "
                       f"plan for --device {backend.cost_device()} or use --costs predicted")
    return backend


def error_band(profile: str | None) -> float:
    """hybrid's band: the profile's held-out error factor (a factor off either way) where it has
    one above 1, else DEFAULT_BAND."""
    if profile:
        try:
            fit = json.loads(open(profile, encoding="utf-8").read()).get("fit") or {}
            factor = float(fit["heldout"]["after"]["error_factor"])
        except (OSError, ValueError, TypeError, KeyError):
            factor = math.nan
        if math.isfinite(factor) and factor > 1.0:
            return factor
    return DEFAULT_BAND


@dataclass
class TuneStats:
    """What measuring cost: distinct choices timed now, read from the database, left predicted."""

    mode: str
    band: float | None
    choices: int = 0
    measured: int = 0
    cached: int = 0
    predicted: int = 0
    refused: int = 0  # computed other outputs than ONNX Runtime's
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        return {"costs": self.mode, "band": self.band, "choices": self.choices, "measured": self.measured,
                "from_database": self.cached, "kept_predicted": self.predicted, "refused": self.refused,
                "wall_s": round(self.wall_s, 3)}

    def line(self) -> str:
        band = f" (band {self.band:.2f}x)" if self.band is not None else ""
        return (f"costs {self.mode}{band}: {self.choices} choices, {self.measured} measured, {self.cached} from the "
                f"timing database, {self.predicted} kept predicted"
                + (f", {self.refused} refused (wrong outputs)" if self.refused else "")
                + f"; measuring took {self.wall_s:.1f} s")


class _Run:
    """One choice's run, named for a sampler that reads which it is (a test's fixed samples)."""

    def __init__(self, run: Callable[[], None], kernel, how: str) -> None:
        self.run, self.kernel, self.how = run, kernel, how

    def __call__(self) -> None:
        self.run()


@dataclass
class _Choice:
    kernel: object
    how: str  # "generated" | "library"
    key: str
    generated: object = None


class Autotuner:
    """The `rules.Measurer` of one prepared model on one backend (module note)."""

    def __init__(self, prep, backend: Backend, mode: str, *, band: float = DEFAULT_BAND,
                 cache: TimingCache | None = None, budget_s: float = BUDGET_S, seed: int = 0,
                 sampler: Callable[..., list[Timing]] | None = None) -> None:
        self.prep, self.graph, self.backend, self.mode = prep, prep.graph, backend, check_costs(mode)
        self.band = band if mode == "hybrid" else None
        self.cache = cache if cache is not None else TimingCache()
        self.budget_s, self.seed, self.sampler = budget_s, seed, sampler or backend.sample
        self.stats = TuneStats(mode, self.band)
        self._known: dict[str, tuple[float | None, str]] = {}
        self._seen: set[tuple] = set()
        self._values: dict | None = None
        self._canonical = None
        self._device = backend.device_label()

    # -- the Measurer ---------------------------------------------------------------------------

    def times(self, kernels: Sequence, costs: Sequence) -> list[tuple[float | None, str]]:
        return self.measure_groups([(kernels, costs)])[0]

    def prefetch(self, legality, budget_per_seed: int) -> None:
        """Time, as one batch, the choices of every candidate the exact solver enumerates
        (`legality` predicts; its verdicts only say which groups are legal)."""
        from fusesearch.candidates.enumerate import enumerate_candidates

        groups = []
        for nodes in enumerate_candidates(legality, budget_per_seed=budget_per_seed).groups:
            verdict = legality.check(nodes)
            options = legality.options(nodes, verdict.kernel) if verdict.decision else None
            fits = legality.priced(options) if isinstance(options, tuple) else []
            if fits:
                groups.append(([k for k, _ in fits], [c for _, c in fits]))
        self.measure_groups(groups)

    def measure_groups(self, groups: Sequence[tuple[Sequence, Sequence]]) -> list[list[tuple[float | None, str]]]:
        """For each group (its choices, their predicted costs): each choice's measured seconds,
        or None and why not."""
        began = time.perf_counter()
        rows, todo = [], {}
        for kernels, costs in groups:
            best = min(c.time_s for c in costs)
            row = []
            for kernel, cost in zip(kernels, costs, strict=True):
                if self.band is not None and cost.time_s > best * self.band:
                    self._count(("band", kernel.nodes, kernel.schedule), None)
                    row.append((None, f"predicted {cost.time_s / best if best else math.inf:.2f}x the group's best, "
                                      f"outside hybrid's {self.band:.2f}x band"))
                    continue
                choice, why = self._choice(kernel)
                if choice is None:
                    self._count(("unmeasurable", kernel.nodes, kernel.schedule), None)
                    row.append((None, why))
                    continue
                row.append(choice.key)
                if choice.key not in self._known:
                    todo.setdefault(choice.key, choice)
            rows.append(row)
        self._time([c for key, c in todo.items() if not self._from_database(key)])
        self.stats.wall_s += time.perf_counter() - began
        return [[self._known[r] if isinstance(r, str) else r for r in row] for row in rows]

    # -- preparing and timing choices -----------------------------------------------------------

    def _count(self, what: tuple, counter: str | None) -> None:
        if what in self._seen:
            return
        self._seen.add(what)
        self.stats.choices += 1
        if counter is None:
            self.stats.predicted += 1
        else:
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    def _choice(self, kernel) -> tuple[_Choice | None, str]:
        """The choice as it runs here and its database key, or None and why it cannot run alone."""
        if kernel.alias:
            return None, "a view: no kernel runs"
        shapes = [list(self.graph.tensors[t].shape or ()) for t in kernel.inputs]
        if kernel.impl != "library":
            try:
                generated = generate(self.graph, kernel, name=KERNEL_NAME)
                return _Choice(kernel, "generated", self._key(generated.source_hash, shapes), generated), ""
            except CodegenRefused as exc:
                if len(kernel.nodes) > 1:
                    return None, f"not measured: codegen refuses the group ({exc})"
        return _Choice(kernel, "library", self._key(self._signature(kernel), shapes)), ""

    def _signature(self, kernel) -> str:
        """A library call's identity: the node's op, attributes, and its tensors' shapes, types and
        constness (what its time depends on), hashed."""
        node = self.graph.nodes[kernel.nodes[0]]
        tensors = [(t, self.graph.tensors[t]) for t in (*node.inputs, *node.outputs) if t]
        doc = {"op": node.op_type, "attrs": {k: repr(v) for k, v in sorted(node.attrs.items())},
               "tensors": [(list(i.shape or ()), i.dtype, bool(i.constant)) for _, i in tensors]}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    def _key(self, source_hash: str, shapes) -> str:
        return TimingCache.key(source_hash, shapes, self._device,
                               f"choice;net of the call{self.backend.timing_key()}")

    def _from_database(self, key: str) -> bool:
        timing = self.cache.get(key)
        if timing is None:
            return False
        self._known[key] = (timing.median_s, "")
        self._count(("key", key), "cached")
        return True

    def _time(self, choices: list[_Choice]) -> None:
        """Compile (in parallel), run once, then sample `BATCH` choices at a time, interleaved."""
        for start in range(0, len(choices), BATCH):
            batch = choices[start:start + BATCH]
            with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
                built = list(pool.map(self._compiled, batch))
            ready = []
            for choice, why in zip(batch, built, strict=True):
                run = why or self._ready(choice)
                if isinstance(run, str):
                    self._known.setdefault(choice.key, (None, run))
                    self._count(("key", choice.key), "refused" if self._known[choice.key][0] == math.inf else None)
                else:
                    ready.append((choice, run))
            if ready:
                self._sample(ready)

    def _compiled(self, choice: _Choice) -> str:
        """Compile a generated choice (the slow part, run in a thread; cached by the backend):
        "" or why it does not compile."""
        if choice.how != "generated":
            return ""
        try:
            self.backend.compile(choice.generated)
        except (FusesearchError, CodegenRefused) as exc:
            return f"not measured: {exc}"
        return ""

    def _ready(self, choice: _Choice) -> _Run | str:
        """The choice's run on the model's values, run once, or why it cannot run."""
        values = self.values()
        try:
            if choice.how == "generated":
                run, fetch = self.backend.runner(choice.generated, {t: values[t] for t in choice.kernel.inputs})
            else:
                call, why = self.backend.library_call(self.canonical(), self.graph, choice.kernel, values)
                if call is None:
                    return f"not measured: {why}"
                run = call[0]
            run()
            wrong = self._wrong(choice, fetch) if choice.how == "generated" else ""
        except Exception as exc:  # the library refusing a node alone, a runner failing: priced instead
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            return f"not measured: {self.backend.library if choice.how == 'library' else 'the kernel'} " \
                   f"cannot run it alone ({first})"
        if wrong:
            self._known[choice.key] = (math.inf, wrong)
            return wrong
        return _Run(run, choice.kernel, choice.how)

    def _wrong(self, choice: _Choice, fetch) -> str:
        """Why the kernel's outputs are not ONNX Runtime's within the model's tolerance (a tensor-core
        skeleton's where it has one), "" when they are: a wrong choice is refused, never priced."""
        from fusesearch.backends.codegen.mma import TOLERANCE
        from fusesearch.ir.precision import prepared_tolerance
        from fusesearch.verify import max_rel_err

        rtol = max(prepared_tolerance(self.prep), TOLERANCE.get(choice.kernel.schedule.skeleton, 0.0))
        err = max_rel_err(fetch(), self.values())
        return "" if err <= rtol else f"refused: its outputs differ from ONNX Runtime's (max rel err {err:.2g} > {rtol:g})"

    def _sample(self, ready: list[tuple[_Choice, _Run]]) -> None:
        nulls = self.backend.null_calls(library=any(c.how == "library" for c, _ in ready),
                                        generated=any(c.how == "generated" for c, _ in ready))
        timings = self.sampler([r for _, r in ready] + list(nulls.runs), budget_s=self.budget_s, rounds=ROUNDS,
                               warmup_s=WARMUP_S, flush=True)
        costs = nulls.costs([t.median_s for t in timings[len(ready):]])
        for (choice, _), timing in zip(ready, timings, strict=False):
            net = costs.net(choice.how, timing)
            self.cache.put(choice.key, net)
            self._known[choice.key] = (net.median_s, "")
            self._count(("key", choice.key), "measured")

    def values(self) -> dict:
        """Every tensor of the model on seeded inputs (ONNX Runtime's), computed once."""
        if self._values is None:
            from fusesearch.verify import all_values, random_feeds

            canonical = self.canonical()
            self._values = all_values(canonical, random_feeds(canonical, self.seed))
        return self._values

    def canonical(self):
        if self._canonical is None:
            from fusesearch.ir.canonicalize import to_proto

            self._canonical = to_proto(self.prep.canonical)
        return self._canonical


def tuner_for(costs: str, prep, spec, profile: str | None = None, *, cache: TimingCache | None = None,
              seed: int = 0, sampler: Callable[..., list[Timing]] | None = None) -> Autotuner | None:
    """The Autotuner `--costs` asks for on `spec` (None for predicted); BadInput where it cannot
    time here."""
    backend = timing_backend(costs, spec)
    if backend is None:
        return None
    return Autotuner(prep, backend, costs, band=error_band(profile), cache=cache, seed=seed, sampler=sampler)


def build_problem(prep, spec, model, config, costs: str = "predicted", profile: str | None = None, *,
                  cache: TimingCache | None = None, sampler: Callable[..., list[Timing]] | None = None):
    """(SearchProblem, Autotuner or None): the search priced as `costs` says; with measured or
    hybrid costs the enumerated candidates' choices are measured first, as one batch."""
    from fusesearch.search.problem import SearchProblem

    tuner = tuner_for(costs, prep, spec, profile, cache=cache, seed=config.seed, sampler=sampler)
    if tuner is not None:
        tuner.prefetch(SearchProblem.build(prep.graph, spec, model, config).legality, config.budget_per_seed)
    return SearchProblem.build(prep.graph, spec, model, config, measurer=tuner), tuner
