"""Measured costs (`--costs measured|hybrid`): time each candidate group's choices and search over them.

Problem: measured, the cost model's order of a group's choices (our C or the library, a tile,
tensor or CUDA cores) is often not the machine's. Approach: `Autotuner` is the `rules.Measurer`
that `Legality.choose` asks; a group's choices run on the plan device's backend in shared rounds
(`backend.sample`, null calls off), each median kept in the timing database (`TimingCache`).
`measured` times every candidate the solver enumerates (`prefetch`, one batch); `hybrid` (`want`,
looped by `tuned_search`) times only the choices of the groups the current plan uses, in the
layout it runs them in (a form: `_form`; those within `band` of the form's best), and searches
again until the plan's forms are all measured (at most MAX_ROUNDS, capped: the last prices untried
forms without the band's optimism; where it still picks some, they are timed and one closing
search runs over timed forms only, so the plan holds measured groups only). An unmeasured choice costs its prediction times its
class's (`cost_class`) median measured/predicted ratio (`Verdict.note`); `docs/DESIGN.md` has the band.
Invariants: with `predicted` nothing here runs; the same database gives the same plan; samples
come through `sampler` (tests pass fixed ones), so nothing depends on wall time but `stats.wall_s`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from statistics import NormalDist

import numpy as np

from fusesearch.backends.codegen import CodegenRefused, generate
from fusesearch.backends.registry import CPU, CUPY, Backend
from fusesearch.backends.timing import Timing, TimingCache
from fusesearch.errors import BadInput, FusesearchError
from fusesearch.layout import laid_out

COSTS = ("predicted", "measured", "hybrid")
DEFAULT_BAND = 1.5  # hybrid: measure choices predicted within this factor of the group's best
MIN_PAIRS = 8  # measured choices before their error spread, not DEFAULT_BAND, sets hybrid's band
MIN_CLASS_PAIRS = 3  # measured choices of a class (`cost_class`) before it has its own scale
BAND_QUANTILE = 80.0  # hybrid's band: this percentile of the model's |log error|
OPTIMISM_QUANTILE = 20.0  # hybrid: a form no plan used yet is priced at this percentile of its plausible cost
MAX_ROUNDS = 10  # hybrid: searches at most (the first is the model's plan; the last without optimism),
# then one over measured forms only where the last picked forms never timed
UNTRIED = 1e3  # hybrid's closing search: a form never timed priced this many times its measured-clock price
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


def error_band(profile: str | None) -> float | None:
    """hybrid's band from the calibrated profile: its held-out error factor (a factor off either
    way) where it has one above 1, else None (the band then comes from the measurements)."""
    if profile:
        try:
            fit = json.loads(open(profile, encoding="utf-8").read()).get("fit") or {}
            factor = float(fit["heldout"]["after"]["error_factor"])
        except (OSError, ValueError, TypeError, KeyError):
            factor = math.nan
        if math.isfinite(factor) and factor > 1.0:
            return factor
    return None


def optimism(band: float, pairwise: bool = False) -> float:
    """What hybrid divides a form no plan used yet by: its price at the OPTIMISM_QUANTILE-th
    percentile of the model's error on one form, the band read as the BAND_QUANTILE-th percentile
    of |a normal log error| (spread s: the band is exp(z((1 + q) / 2) s), the optimism
    exp(z(1 - o) s): band ** 0.66 at 80 and 20) or, `pairwise` (`group_band`), of |the difference
    of two such errors| (spread s x sqrt 2: band ** 0.46). Dividing by the whole band (the 10th
    percentile) made every later search lean on untried forms (the CNNs timed 36-66% of their
    choices, `benchmarks/bench_hybrid.md`)."""
    z = NormalDist().inv_cdf
    spread = z((1 + BAND_QUANTILE / 100) / 2) * (math.sqrt(2) if pairwise else 1.0)
    return band ** (z(1 - OPTIMISM_QUANTILE / 100) / spread)


def measured_scale(pairs: Sequence[tuple[float, float]]) -> float:
    """The median measured/predicted ratio of (predicted, measured) seconds: what puts a predicted
    cost on the measured clock (1.0 without pairs)."""
    ratios = [m / p for p, m in pairs if p > 0 and m > 0]
    return float(np.median(ratios)) if ratios else 1.0


def cost_class(kernel) -> str:
    """What the model errs alike on: a generated kernel's template and code path (its product on a
    CPU, "conv/nchwc", else its skeleton, "gemm/mma"); the library's calls apart. A group's
    choices differ in code path, which the model prices by rates that err each its own way: one
    scale per template left their errors in the band, so on the CNNs every conv choice fell
    within it and was timed."""
    if kernel.impl == "library":
        return "library"
    return f"{kernel.template}/{kernel.schedule.product or kernel.schedule.skeleton.value}"


def clock_scales(pairs: Sequence[tuple[str, float, float]]) -> dict[str | None, float]:
    """Each class's scale (of (class, predicted, measured) pairs; `measured_scale`) where it has
    MIN_CLASS_PAIRS, and under None that of all our kernels' pairs (the library's calls, an
    opaque op's above all, err apart: only where there is nothing else)."""
    ours = [(p, m) for c, p, m in pairs if c != "library"]
    scales: dict[str | None, float] = {None: measured_scale(ours or [(p, m) for _, p, m in pairs])}
    for template in sorted({t for t, _, _ in pairs}):
        own = [(p, m) for t, p, m in pairs if t == template]
        if len(own) >= MIN_CLASS_PAIRS:
            scales[template] = measured_scale(own)
    return scales


def data_band(pairs: Sequence[tuple[str, float, float]], scales: dict[str | None, float]) -> float:
    """The model's error factor on measured (template, predicted, measured) pairs once each is on
    the measured clock: the BAND_QUANTILE-th percentile of |log(measured / (scale x predicted))|,
    as a factor; DEFAULT_BAND with fewer than MIN_PAIRS."""
    logs = [abs(math.log(m / (scales.get(t, scales[None]) * p))) for t, p, m in pairs if p > 0 and m > 0]
    if len(logs) < MIN_PAIRS:
        return DEFAULT_BAND
    return float(math.exp(np.percentile(logs, BAND_QUANTILE)))


def group_band(pairs: Mapping[str, tuple[str, float, float]], group_of: Mapping[str, frozenset[int]],
               scales: dict[str | None, float]) -> float | None:
    """The model's error on the order of a group's choices: over every two measured choices of
    one group (`pairs`: key -> (class, predicted, measured); `group_of`: key -> the group's
    nodes), each on the measured clock, the BAND_QUANTILE-th percentile of |the difference of
    their log errors|, as a factor; None with fewer than MIN_PAIRS such pairs. What hybrid's
    band asks is whether a choice predicted slower than its group's best may be faster, which
    only the two errors' difference decides: the error a group's choices share (its shape, its
    place in the cache) cancels, so this band is narrower than `data_band`'s."""
    errors: dict[frozenset[int], list[float]] = {}
    for key, (cls, p, m) in pairs.items():
        if p > 0 and m > 0 and key in group_of:
            errors.setdefault(group_of[key], []).append(math.log(m / (scales.get(cls, scales[None]) * p)))
    diffs = [abs(a - b) for logs in errors.values() for i, a in enumerate(logs) for b in logs[i + 1:]]
    if len(diffs) < MIN_PAIRS:
        return None
    return float(math.exp(np.percentile(diffs, BAND_QUANTILE)))


# a choice's status (the TuneStats field counting it), which only rises
_RANK = {"predicted": 0, "refused": 1, "cached": 2, "measured": 3}


@dataclass
class TuneStats:
    """What measuring cost: distinct choices seen, timed now, read from the database, left
    predicted, refused; hybrid's searches, and the band and scales it ended with."""

    mode: str
    band: float | None
    choices: int = 0
    measured: int = 0
    cached: int = 0
    predicted: int = 0
    refused: int = 0  # computed other outputs than ONNX Runtime's
    outside_band: int = 0  # hybrid: of those kept predicted, predicted beyond the band of their group's best
    lone: int = 0  # of those timed, the only choice of their group (timed to compare groups, not choices)
    wall_s: float = 0.0
    rounds: int = 1  # searches run (hybrid: the model's plan, then one per new set of groups measured)
    capped: bool = False  # hybrid: searches reached MAX_ROUNDS (the last without the band's optimism, then a closing one)
    scales: dict = field(default_factory=lambda: {None: 1.0})  # `clock_scales`: unmeasured choices' factor

    @property
    def timed(self) -> int:
        """Choices priced by a measurement: timed now or read from the database."""
        return self.measured + self.cached

    def to_dict(self) -> dict:
        return {"costs": self.mode, "band": self.band, "choices": self.choices, "measured": self.measured,
                "from_database": self.cached, "kept_predicted": self.predicted, "refused": self.refused,
                "timed_fraction": round(self.timed / self.choices, 4) if self.choices else 0.0,
                "outside_band": self.outside_band, "lone_choices": self.lone,
                "rounds": self.rounds, "capped": self.capped, "scale": round(self.scales[None], 4),
                "template_scales": {t: round(v, 4) for t, v in self.scales.items() if t is not None},
                "wall_s": round(self.wall_s, 3)}

    def line(self) -> str:
        band = f" (band {self.band:.2f}x)" if self.band is not None else ""
        rounds = (f", {self.rounds} searches" + (" (capped: the last without the band's optimism)" if self.capped else "")
                  if self.mode == "hybrid" else "")
        share = f" ({self.timed / self.choices:.0%} of the choices timed, {self.lone} of them their group's only one)" \
            if self.choices else ""
        outside = f" ({self.outside_band} outside the band)" if self.mode == "hybrid" else ""
        return (f"costs {self.mode}{band}: {self.choices} choices, {self.measured} measured, {self.cached} from the "
                f"timing database{share}, {self.predicted} kept predicted{outside}"
                + (f", {self.refused} refused (wrong outputs)" if self.refused else "")
                + f"{rounds}; measuring took {self.wall_s:.1f} s")


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
    """The `rules.Measurer` of one prepared model on one backend (module note). `band`: hybrid's
    fixed band (the profile's); None: from the measurements (`data_band`)."""

    def __init__(self, prep, backend: Backend, mode: str, *, band: float | None = None,
                 cache: TimingCache | None = None, budget_s: float = BUDGET_S, seed: int = 0,
                 sampler: Callable[..., list[Timing]] | None = None) -> None:
        self.prep, self.graph, self.backend, self.mode = prep, prep.graph, backend, check_costs(mode)
        self._fixed_band = band
        self.cache = cache if cache is not None else TimingCache()
        self.budget_s, self.seed, self.sampler = budget_s, seed, sampler or backend.sample
        self.scales: dict[str | None, float] = {None: 1.0}  # fixed during a search (`rescale` between)
        self._known: dict[str, tuple[float | None, str]] = {}
        self._status: dict[object, str] = {}  # each distinct choice: how it was priced (`_RANK`)
        self._pairs: dict[str, tuple[str, float, float]] = {}  # key -> (class, predicted, measured)
        self._group_of: dict[str, frozenset[int]] = {}  # key -> the nodes of the group it is a choice of
        self._wanted: set[tuple[frozenset[int], bool]] = set()  # hybrid: the forms (`_form`) some plan used
        self.optimistic = True  # hybrid: an unmeasured form's price divided by the band (off past the cap)
        self.closed = False  # hybrid's closing search: a form never timed priced out of reach (UNTRIED)
        self._outside: set[str] = set()  # hybrid: choices skipped as beyond their group's band
        self._lone: set[str] = set()  # choices that were their group's only one
        self._values: dict | None = None
        self._canonical = None
        self._device = backend.device_label()
        self.band, self.pairwise = self._band()  # hybrid's (module note), fixed during a search; None: measure all
        self.stats = TuneStats(mode, self.band)

    def scale(self, kernel) -> float:
        """What puts `kernel`'s predicted cost on the measured clock: its class's scale, else all's;
        hybrid divides a choice of a form no plan used yet by `optimism(band)` (a group, or a
        group in the other layout, that the model may have overpriced by its usual error is tried,
        measured, and kept only if it holds)."""
        scale = self.scales.get(cost_class(kernel), self.scales[None])
        if self.mode == "hybrid" and _form(kernel) not in self._wanted:
            if self.closed:
                return scale * UNTRIED
            if self.optimistic:
                scale /= optimism(self.band, self.pairwise)
        return scale

    def rescale(self) -> None:
        """Put unmeasured choices on the clock of the ones measured so far, and hybrid's band to
        their error (between searches: verdicts are memoized)."""
        self.scales = self.stats.scales = clock_scales(list(self._pairs.values()))
        self.band, self.pairwise = self._band()
        self.stats.band = self.band

    def _band(self) -> tuple[float | None, bool]:
        """hybrid's band and whether it is of two choices' difference (`group_band`; `optimism`)."""
        if self.mode != "hybrid":
            return None, False
        if self._fixed_band is not None:
            return self._fixed_band, False
        within = group_band(self._pairs, self._group_of, self.scales)
        if within is not None:
            return within, True
        return data_band(list(self._pairs.values()), self.scales), False

    # -- the Measurer ---------------------------------------------------------------------------

    def times(self, kernels: Sequence, costs: Sequence) -> list[tuple[float | None, str]]:
        return self.measure_groups([(kernels, costs)])[0]

    def prefetch(self, legality, budget_per_seed: int) -> None:
        """Time, as one batch, the choices of every candidate the exact solver enumerates
        (`legality` predicts; its verdicts only say which groups are legal)."""
        from fusesearch.candidates.enumerate import blocked_only_candidates, enumerate_candidates

        groups = enumerate_candidates(legality, budget_per_seed=budget_per_seed).groups
        self.measure_groups(_priced(legality, (*groups, *blocked_only_candidates(legality))))
        self.rescale()

    def want(self, plan, legality) -> bool:
        """hybrid: measure the choices of the plan's forms (each group in the layout the plan runs
        it in) not measured before (one batch) and rescale; False when there was none (the plan
        was searched over their measured costs)."""
        new = [f for f in dict.fromkeys(_form(g.kernel) for g in plan.groups) if f not in self._wanted]
        if not new:
            return False
        self._wanted.update(new)
        self.measure_groups(_priced(legality, list(dict.fromkeys(nodes for nodes, _ in new))))
        self.rescale()
        self.stats.rounds += 1
        return True

    def measure_groups(self, groups: Sequence[tuple[Sequence, Sequence]]) -> list[list[tuple[float | None, str]]]:
        """For each group (its choices, their predicted costs): each choice's measured seconds,
        or None and why not (hybrid: a group no plan used, a choice outside the band)."""
        began = time.perf_counter()
        rows, todo = [], {}
        for kernels, costs in groups:
            scaled = [self.scale(k) * c.time_s for k, c in zip(kernels, costs, strict=True)]  # on one clock
            best = min(scaled)
            wanted = self.mode != "hybrid" or _form(kernels[0]) in self._wanted
            row = []
            for kernel, cost, on_clock in zip(kernels, costs, scaled, strict=True):
                choice, why = self._choice(kernel)
                if choice is None:
                    self._mark(("unmeasurable", kernel.nodes, kernel.schedule), "predicted")
                    row.append((None, why))
                    continue
                skip = _skip(wanted, on_clock, best, self.band)
                if skip and choice.key not in self._known:
                    self._mark(choice.key, "predicted")
                    if wanted:  # in a plan's group: beyond the band
                        self._outside.add(choice.key)
                    row.append((None, skip))
                    continue
                if len(kernels) == 1:
                    self._lone.add(choice.key)
                row.append((choice.key, cost_class(kernel), cost.time_s))
                self._group_of.setdefault(choice.key, frozenset(kernel.nodes))
                if choice.key not in self._known:
                    todo.setdefault(choice.key, choice)
            rows.append(row)
        self._time([c for key, c in todo.items() if not self._from_database(key)])
        self.stats.outside_band = sum(self._status.get(k) == "predicted" for k in self._outside)
        self.stats.lone = sum(self._status.get(k) in ("measured", "cached") for k in self._lone)
        self.stats.wall_s += time.perf_counter() - began
        return [[self._timed(*r) if isinstance(r[0], str) else r for r in row] for row in rows]

    def _timed(self, key: str, kind: str, predicted_s: float) -> tuple[float | None, str]:
        """A measured choice's seconds (kept beside its predicted cost for the scale and band)."""
        seconds, why = self._known[key]
        if seconds is not None and math.isfinite(seconds):
            self._pairs.setdefault(key, (kind, predicted_s, seconds))
        return seconds, why

    # -- preparing and timing choices -----------------------------------------------------------

    def _mark(self, what: object, status: str) -> None:
        """Count a distinct choice under `status`, or move it to a higher one (predicted, then
        refused, read from the database or measured)."""
        old = self._status.get(what)
        if old is not None and _RANK[old] >= _RANK[status]:
            return
        if old is None:
            self.stats.choices += 1
        else:
            setattr(self.stats, old, getattr(self.stats, old) - 1)
        self._status[what] = status
        setattr(self.stats, status, getattr(self.stats, status) + 1)

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
        self._mark(key, "cached")
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
                    self._mark(choice.key, "refused" if self._known[choice.key][0] == math.inf else "predicted")
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
                run, fetch = laid_out(self.backend.runner, choice.generated, {t: values[t] for t in choice.kernel.inputs},
                                      {t: v.shape for t, v in values.items()})
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
        for (choice, _), net in zip(ready, self._nets(ready, self.budget_s, ROUNDS), strict=True):
            self.cache.put(choice.key, net)
            self._known[choice.key] = (net.median_s, "")
            self._mark(choice.key, "measured")

    def _nets(self, ready: list[tuple[_Choice, _Run]], budget_s: float, rounds: int) -> list[Timing]:
        """The ready choices sampled in one interleaved call with the backend's null calls, each
        Timing net of its calling path's."""
        nulls = self.backend.null_calls(library=any(c.how == "library" for c, _ in ready),
                                        generated=any(c.how == "generated" for c, _ in ready))
        timings = self.sampler([r for _, r in ready] + list(nulls.runs), budget_s=budget_s, rounds=rounds,
                               warmup_s=WARMUP_S, flush=True)
        costs = nulls.costs([t.median_s for t in timings[len(ready):]])
        return [costs.net(choice.how, timing) for (choice, _), timing in zip(ready, timings, strict=False)]

    def sample(self, kernels: Sequence, *, budget_s: float, rounds: int) -> list[Timing | str]:
        """Each kernel timed afresh, all interleaved in one call, net of the null calls, nothing
        stored (an A/B of choices, with its spread): a Timing, or why it cannot run alone."""
        out: list[Timing | str] = []
        ready = []
        for kernel in kernels:
            choice, why = self._choice(kernel)
            run = why if choice is None else self._compiled(choice) or self._ready(choice)
            out.append(run if isinstance(run, str) else "")
            if not isinstance(run, str):
                ready.append((len(out) - 1, choice, run))
        nets = self._nets([(c, r) for _, c, r in ready], budget_s, rounds) if ready else []
        for (i, _, _), net in zip(ready, nets, strict=True):
            out[i] = net
        return out

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


def _form(kernel) -> tuple[frozenset[int], bool]:
    """A group's form: its nodes and whether it runs in another layout than the model's."""
    return frozenset(kernel.nodes), kernel.schedule.layout_in.blocked or kernel.schedule.layout_out.blocked


def _skip(wanted: bool, predicted_s: float, best_s: float, band: float | None) -> str:
    """Why hybrid leaves a choice at its predicted cost ("" to measure it): `predicted_s` and the
    group's best on the measured clock (`Autotuner.scale`: each class's scale, so the library's
    call, which the model errs on apart from our kernels, is compared as measured)."""
    if not wanted:
        return "hybrid: no plan used its group in this layout"
    if band is not None and predicted_s > best_s * band:
        return (f"predicted {predicted_s / best_s if best_s else math.inf:.2f}x the group's best, "
                f"outside hybrid's {band:.2f}x band")
    return ""


def _priced(legality, node_sets: Iterable[frozenset[int]]) -> list[tuple[list, list]]:
    """Each legal group's choices that fit the device and their predicted costs (what is timed),
    and apart from them its forms in the other layout where plans may choose one (`Legality.blocked`
    then reads their times from the same batch; a group with a blocked form alone, those only)."""
    groups = []
    for nodes in node_sets:
        verdict = legality.check(nodes)
        options = legality.options(nodes, verdict.kernel) if verdict.decision else None
        blocked = legality.layout.blocked and (bool(verdict.decision) or legality.blocked_only(nodes))
        for fits in ((legality.priced(options) if isinstance(options, tuple) else []),
                     (legality.priced(legality.blocked_options(nodes)) if blocked else [])):
            if fits:
                groups.append(([k for k, _ in fits], [c for _, c in fits]))
    return groups


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
    """(SearchProblem, Autotuner or None): the search priced as `costs` says; with measured costs
    the enumerated candidates' choices are measured first, as one batch (hybrid's first search
    is the model's: `tuned_search` measures after it)."""
    from fusesearch.search.problem import SearchProblem

    tuner = tuner_for(costs, prep, spec, profile, cache=cache, seed=config.seed, sampler=sampler)
    if tuner is not None and tuner.mode == "measured":
        tuner.prefetch(SearchProblem.build(prep.graph, spec, model, config).legality, config.budget_per_seed)
    return SearchProblem.build(prep.graph, spec, model, config, measurer=tuner), tuner


def tuned_search(prep, spec, model, strategy: str, config, costs: str = "predicted", profile: str | None = None, *,
                 cache: TimingCache | None = None, sampler: Callable[..., list[Timing]] | None = None,
                 **search_kwargs):
    """(Plan, its SearchProblem): `strategy`'s plan priced as `costs` says; hybrid searches again
    after measuring each new plan's groups until a plan uses only measured groups (module note).
    A plan priced by measurements carries what measuring cost (`Plan.tuning`)."""
    from fusesearch.search import search
    from fusesearch.search.problem import SearchProblem

    problem, tuner = build_problem(prep, spec, model, config, costs, profile, cache=cache, sampler=sampler)
    result = search(prep.graph, spec, model, strategy, config=config, profile=profile, problem=problem,
                    **search_kwargs)
    if tuner is None:
        return result, problem
    while tuner.mode == "hybrid" and not tuner.closed and tuner.want(result, problem.legality):
        tuner.optimistic = tuner.stats.rounds < MAX_ROUNDS  # the cap's search: no optimism left
        tuner.closed = tuner.stats.rounds > MAX_ROUNDS  # the capped search picked untried forms: timed now
        tuner.stats.capped = not tuner.optimistic
        problem = SearchProblem.build(prep.graph, spec, model, config, measurer=tuner)
        result = search(prep.graph, spec, model, strategy, config=config, profile=profile, problem=problem,
                        **search_kwargs)
    return replace(result, tuning=tuner.stats.to_dict()), problem
