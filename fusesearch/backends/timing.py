"""Timing of kernels: warm-up, budgeted sampling, robust statistics and an on-disk cache.

Problem: a kernel's time is noisy, one sample says little, and re-measuring every kernel on each
sweep wastes device time.
Approach: `measure` warms up for `warmup_s`, then times one run per sample (an untimed
`before_each` first) by a `Clock` (`PerfCounterClock`, `CudaEventClock`) until `budget_s`, within
`min_samples`..`max_samples`; `measure_interleaved` samples runs in rounds so compared runs see the
same machine. `Timing` keeps every sample (median, 20th/80th percentiles); `TimingCache` one JSON
file per key. On a GPU `graph_timing` times N launches in one CUDA graph (`GraphDevice`) per
sample, cache state "warm" or "flushed" (flushes timed alone and taken off), an empty kernel's
launch reported apart as `launch_s`; an uncapturable run is timed as enqueued launches (`timer`
"events").
Invariants: a `Timing` has at least one sample, each >= 0 s; the loop depends only on arguments and
elapsed `now` (no sleeps; tests pass a fake clock); a cache file is written whole (os.replace) and a
corrupt or foreign one reads as missing."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import operator
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)

CACHE_ENV = "FUSESEARCH_CACHE"
CACHE_SCHEMA = "fusesearch.timing/1"
_KEY_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Timing:
    """Every sample of one measurement (seconds), how many warm-up runs preceded them, the clock."""

    samples_s: tuple[float, ...]
    warmup_runs: int
    clock: str  # "perf_counter" | "cuda_event"
    timer: str = ""  # "graph" | "events" on a GPU (`graph_timing`); "" for one run per sample
    cache: str = ""  # "flushed" | "warm" where the timer says (GPU)
    launch_s: float | None = None  # an empty kernel's launch in a graph, reported apart (GPU)
    launches: int = 0  # N launches per timed replay (GPU)

    def __post_init__(self) -> None:
        if not self.samples_s:
            raise ValueError("a Timing needs at least one sample")
        if any(not math.isfinite(s) or s < 0 for s in self.samples_s):
            raise ValueError(f"samples must be finite and >= 0 s, got {self.samples_s[:5]}...")
        if self.warmup_runs < 0:
            raise ValueError(f"warmup_runs must be >= 0, got {self.warmup_runs}")
        if not self.clock:
            raise ValueError("a Timing needs the name of its clock")

    @property
    def n(self) -> int:
        return len(self.samples_s)

    def less(self, fixed_s: float, floor_s: float = 0.0) -> Timing:
        """Every sample less a fixed cost the calling path adds to each, at least `floor_s`."""
        return replace(self, samples_s=tuple(max(floor_s, s - fixed_s) for s in self.samples_s))

    @property
    def median_s(self) -> float:
        return self._percentile(50.0)

    @property
    def p20_s(self) -> float:
        return self._percentile(20.0)

    @property
    def p80_s(self) -> float:
        return self._percentile(80.0)

    def _percentile(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.samples_s, dtype=np.float64), q, method="linear"))

    def to_row(self) -> dict[str, Any]:
        """The summary: one row of a measurements table."""
        return {"median_s": self.median_s, "p20_s": self.p20_s, "p80_s": self.p80_s,
                "n": self.n, "warmup_runs": self.warmup_runs, "clock": self.clock, **self.how_timed()}

    def how_timed(self) -> dict[str, Any]:
        """How a GPU figure was taken (timer, cache state, launch cost, N); {} for one run per sample."""
        if not self.timer:
            return {}
        return {"timer": self.timer, "cache": self.cache, "launch_s": self.launch_s, "launches": self.launches}

    def to_dict(self) -> dict[str, Any]:
        """Everything, samples included (what the cache stores)."""
        return {"samples_s": list(self.samples_s), "warmup_runs": self.warmup_runs,
                "clock": self.clock, **self.how_timed()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Timing:
        launch_s = data.get("launch_s")
        return cls(samples_s=tuple(float(s) for s in data["samples_s"]),
                   warmup_runs=int(data["warmup_runs"]), clock=str(data["clock"]),
                   timer=str(data.get("timer", "")), cache=str(data.get("cache", "")),
                   launch_s=None if launch_s is None else float(launch_s), launches=int(data.get("launches", 0)))


NOT_DISTINGUISHABLE = "not distinguishable"


def distinguishable(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two measured figures, each given as its (p20, p80) range, differ beyond their
    noise: the ranges do not overlap. Every comparison of measured figures is decided here."""
    return a[1] < b[0] or b[1] < a[0]


def spread(t: Timing) -> tuple[float, float]:
    return (t.p20_s, t.p80_s)


@dataclass(frozen=True)
class Paired:
    """One program's time over another's, round by round: the median and p20-p80 of the ratios
    of their samples taken in the same round (`paired`). A shared machine's slow drifts and
    modes (a neighbour's burst lasting many rounds) stretch both samples of a round alike, so
    this range is narrower than either program's own spread: the two differ beyond their noise
    where it excludes 1."""

    median: float
    p20: float
    p80: float
    n: int

    @property
    def distinguishable(self) -> bool:
        return self.p80 < 1.0 or self.p20 > 1.0

    def compared(self, a_faster: str, b_faster: str) -> str:
        """`a_faster` where a took less time in most rounds (p80 below 1), `b_faster` where more
        (p20 above 1), else "not distinguishable" (as `compared` for two ranges)."""
        return a_faster if self.p80 < 1.0 else b_faster if self.p20 > 1.0 else NOT_DISTINGUISHABLE

    def text(self, digits: int = 2) -> str:
        """'0.81x (0.80-0.83)': the median and its p20-p80."""
        return f"{self.median:.{digits}f}x ({self.p20:.{digits}f}-{self.p80:.{digits}f})"

    def to_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "p20": self.p20, "p80": self.p80, "n": self.n}


def paired(a: Timing, b: Timing) -> Paired | None:
    """a's samples over b's, the i-th of each taken in the same round (`run._timed` times each
    program once per round, in turn); None where their counts differ (not timed in rounds)."""
    if a.n != b.n or any(s <= 0 for s in b.samples_s):
        return None
    ratios = np.asarray(a.samples_s, dtype=np.float64) / np.asarray(b.samples_s, dtype=np.float64)
    p20, median, p80 = (float(np.percentile(ratios, q, method="linear")) for q in (20.0, 50.0, 80.0))
    return Paired(median, p20, p80, a.n)


def compared(a: tuple[float, float], b: tuple[float, float], a_faster: str, b_faster: str) -> str:
    """`a_faster` where a's range lies below b's, `b_faster` where above, else "not distinguishable"."""
    if not distinguishable(a, b):
        return NOT_DISTINGUISHABLE
    return a_faster if a[1] < b[0] else b_faster


LOAD_WARNING = ("load average {load:.2f} over the last minute on {cpus} CPU{s}, {threads} of them timing here: "
                "the machine is busy while timing, so the figures are noisier (see each one's p20-p80)")
# Several OpenMP threads that spin between kernels (`probes.OPENMP_WAIT`) lose far more than one
# when the machine has fewer free CPUs than they are: a thread spins while its partner waits for a
# core (llama-prefill at 2 threads, load 3.4 on 2 CPUs: 73 ms spinning, 1.1 ms passive, 0.8 ms
# at 1 thread). Said with the load warning, with the way out.
SPIN_WARNING = "; its {threads} OpenMP threads spin between kernels: set OMP_WAIT_POLICY=PASSIVE for figures that degrade less"


def openmp_spins() -> bool:
    """Whether the OpenMP threads spin between regions (anything but a passive policy or a zero count)."""
    return (os.environ.get("OMP_WAIT_POLICY", "").strip().lower() != "passive"
            and os.environ.get("GOMP_SPINCOUNT", "").strip() != "0")


def load_warning(load: float | None = None, cpus: int | None = None, threads: int = 1,
                 spinning: bool | None = None) -> str | None:
    """A warning line when the 1-minute load average, less the `threads` the timing itself keeps
    busy (its own work counts in the average), is above half the CPUs it leaves to the rest (at
    least half a CPU), else None; where several threads spin (`spinning`, else `openmp_spins`) and
    the rest take more than the CPUs they leave, `SPIN_WARNING` too. `load`, `cpus`: the
    machine's unless given."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not available on this system
            return None
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:
            cpus = os.cpu_count() or 1
    others = load - threads
    if others <= max(cpus - threads, 1) / 2:
        return None
    line = LOAD_WARNING.format(load=load, cpus=cpus, s="s" if cpus != 1 else "", threads=threads)
    spins = openmp_spins() if spinning is None else spinning
    return line + (SPIN_WARNING.format(threads=threads) if threads > 1 and spins and others > cpus - threads else "")


# libgomp binds the process's first thread to one place when OMP_PROC_BIND (or OMP_PLACES, or
# GOMP_CPU_AFFINITY) asks it to, and the threads ONNX Runtime creates inherit that one place: its
# intra-op pool then runs on one core (yolo-neck at 2 threads, OMP_PROC_BIND=close
# OMP_PLACES=cores: ONNX Runtime 31.6 ms against 13.1 ms unbound; our plan 10.7 and 11.4 ms).
BIND_VARIABLES = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")
BIND_WARNING = ("{name}={value} binds this process's first thread to one CPU, and ONNX Runtime's {threads} "
                "threads inherit it: its figures here run on one core; unset {names} to compare")


def binding_warning(threads: int, environ=None) -> str | None:
    """`BIND_WARNING` where a thread-binding variable is set (not OMP_PROC_BIND=false) and ONNX
    Runtime is timed on more than one thread, else None."""
    environ = os.environ if environ is None else environ
    bound = [(name, environ[name].strip()) for name in BIND_VARIABLES if environ.get(name, "").strip()]
    bound = [(name, value) for name, value in bound if not (name == "OMP_PROC_BIND" and value.lower() == "false")]
    if threads <= 1 or not bound:
        return None
    return BIND_WARNING.format(name=bound[0][0], value=bound[0][1], threads=threads,
                               names="/".join(BIND_VARIABLES))


def warn_if_loaded(threads: int = 1) -> None:
    """Log `load_warning`'s line and `binding_warning`'s, if any, before timing on `threads` threads."""
    for line in (load_warning(threads=threads), binding_warning(threads)):
        if line:
            log.warning(line)


class Clock(Protocol):
    """Times one run: `stop(start())` is the seconds elapsed between the two calls."""

    name: str

    def start(self) -> object: ...

    def stop(self, token: object) -> float: ...


class PerfCounterClock:
    """Host wall time from `time.perf_counter_ns` (integer ns, so no float drift)."""

    name = "perf_counter"

    def start(self) -> object:
        return time.perf_counter_ns()

    def stop(self, token: object) -> float:
        return (time.perf_counter_ns() - operator.index(token)) * 1e-9


def measure(run: Callable[[], None], *, clock: Clock | None = None, budget_s: float = 0.25,
            warmup_s: float = 0.05, min_samples: int = 5, max_samples: int = 1000,
            before_each: Callable[[], None] | None = None, now: Callable[[], float] = time.perf_counter) -> Timing:
    """Warm `run` up for `warmup_s` (at least once), then sample it within `budget_s` of wall time
    (as `now` reads it, in seconds)."""
    _check_measure_args(budget_s, warmup_s, min_samples, max_samples)
    clock = clock if clock is not None else PerfCounterClock()
    warmup_runs = _warm_up(run, clock, warmup_s, now)
    samples = _sample(run, clock, budget_s, min_samples, max_samples, before_each, now)
    return Timing(samples_s=tuple(samples), warmup_runs=warmup_runs, clock=clock.name)


def measure_interleaved(runs: list[Callable[[], None]], *, clock: Clock | None = None, budget_s: float = 0.25,
                        rounds: int = 5, warmup_s: float = 0.05, before_each: Callable[[], None] | None = None,
                        now: Callable[[], float] = time.perf_counter, min_samples: int = 1,
                        max_samples: int = 1000) -> list[Timing]:
    """One Timing per run of `runs`, sampled in `rounds` passes over all of them in order, each
    pass giving every run `budget_s / rounds` of wall time (at least one sample) after one warm-up
    run (the first pass warms up for `warmup_s`). What a shared machine does over minutes (another
    tenant, a frequency change) then falls on every run alike, and runs listed next to each other
    (a fused kernel and the kernels it replaces) are sampled seconds apart, so their ratio holds
    even where each one's absolute time drifts. `min_samples`/`max_samples` bound each pass's
    samples of each run (one run in one round is `measure`)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    _check_measure_args(budget_s, warmup_s, min_samples, max_samples)
    clock = clock if clock is not None else PerfCounterClock()
    samples: list[list[float]] = [[] for _ in runs]
    warmups = [0] * len(runs)
    for r in range(rounds):
        for i, run in enumerate(runs):
            warmups[i] += _warm_up(run, clock, warmup_s if r == 0 else 0.0, now)
            samples[i] += _sample(run, clock, budget_s / rounds, min_samples, max_samples, before_each, now)
    return [Timing(samples_s=tuple(s), warmup_runs=w, clock=clock.name) for s, w in zip(samples, warmups, strict=True)]


TARGET_S = 1e-3  # one replay lasts at least this long (from the first estimate), so events' resolution and
# the replay's own launch are small beside it
MAX_LAUNCHES = 1000  # launches per graph at most (capture time and graph size)
EST_FLOOR_S = 1e-7  # an estimate never below this (an empty kernel on a fast clock)
CACHE_STATES = ("warm", "flushed")


class GraphDevice(Protocol):
    """What `graph_timing` asks of a GPU (`cupy.GraphTimer`; a test passes a fake one): `clock()`
    brackets work on the device's stream; `enqueue(fn)` runs `fn`'s launches on that stream;
    `capture(fn)` returns those launches as a replayable graph (raises where they cannot be
    captured); `replay(graph)` launches it on the stream; `empty()` and `flush()` launch the
    empty kernel and the L2 flush kernel (both capturable)."""

    def clock(self) -> Clock: ...

    def enqueue(self, fn: Callable[[], None]) -> None: ...

    def capture(self, fn: Callable[[], None]) -> object: ...

    def replay(self, graph: object) -> None: ...

    def empty(self) -> None: ...

    def flush(self) -> None: ...


@dataclass(frozen=True)
class _Program:
    """N launches of one run (each after a flush where asked), ready to time: `go` replays the
    graph ("graph") or enqueues the launches back to back ("events")."""

    go: Callable[[], None]
    launches: int
    timer: str


def launches_for(estimate_s: float, target_s: float = TARGET_S, max_launches: int = MAX_LAUNCHES) -> int:
    """N launches so N x `estimate_s` lasts at least `target_s`: 1 <= N <= `max_launches`."""
    if max_launches < 1 or not target_s > 0:
        raise ValueError(f"need max_launches >= 1 and target_s > 0, got {max_launches}, {target_s}")
    return max(1, min(max_launches, math.ceil(target_s / max(estimate_s, EST_FLOOR_S))))


def graph_timing(runs: list[Callable[[], None]], device: GraphDevice, *, budget_s: float = 0.25, rounds: int = 5,
                 warmup_s: float = 0.05, flush: bool = False, target_s: float = TARGET_S,
                 max_launches: int = MAX_LAUNCHES, now: Callable[[], float] = time.perf_counter,
                 min_samples: int = 1, max_samples: int = 1000) -> list[Timing]:
    """One Timing per run of `runs` (each enqueues its launches on the current stream): samples
    are seconds per launch, taken from replays of a graph of N launches (module note).

    `flush`: an L2 flush kernel before each launch inside the graph ("flushed"); a graph of N
    flushes alone, timed in the same rounds, is taken off each replay, so a sample is the
    kernel's own time from cold memory (at least 0); else "warm", launch after launch. Every run
    is timed in the same cache state, so figures compared with each other were taken alike.
    N per run: `launches_for` one event-timed launch (after one untimed launch). The runs, then
    the empty kernel's graph, then the flush graphs, are replayed in `rounds` interleaved passes
    (`measure_interleaved`: A, B, A, B ...). `launch_s` is the empty kernel's time per launch in
    its graph, reported beside each figure and not taken off it. `min_samples`/`max_samples`:
    replays per run per pass."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    before = device.flush if flush else None
    clock = device.clock()
    programs = [_program(device, clock, run, before, target_s, max_launches) for run in runs]
    empty = _program(device, clock, device.empty, None, target_s, max_launches)
    flushes = {n: _program(device, clock, device.flush, None, target_s, max_launches, n)
               for n in sorted({p.launches for p in programs})} if flush else {}
    timed = [*programs, empty, *flushes.values()]
    timings = measure_interleaved([p.go for p in timed], clock=clock, budget_s=budget_s, rounds=rounds,
                                  warmup_s=warmup_s, now=now, min_samples=min_samples, max_samples=max_samples)
    by_program = dict(zip(map(id, timed), timings, strict=True))
    launch_s = by_program[id(empty)].median_s / empty.launches
    cache = "flushed" if flush else "warm"
    out = []
    for p in programs:
        t = by_program[id(p)]
        flush_s = by_program[id(flushes[p.launches])].median_s if flush else 0.0
        out.append(Timing(tuple(max(0.0, s - flush_s) / p.launches for s in t.samples_s), t.warmup_runs, t.clock,
                          timer=p.timer, cache=cache, launch_s=launch_s, launches=p.launches))
    return out


def _program(device: GraphDevice, clock: Clock, run: Callable[[], None], before: Callable[[], None] | None, target_s: float,
             max_launches: int, launches: int | None = None) -> _Program:
    """`run` N times (`before` ahead of each) as one graph, or as launches enqueued back to back
    where capture fails; N from `launches_for` one timed launch unless given."""
    def once() -> None:
        if before is not None:
            before()
        run()

    if launches is None:
        device.enqueue(once)  # untimed: a first launch compiles, allocates, picks an algorithm
        token = clock.start()
        device.enqueue(once)
        launches = launches_for(float(clock.stop(token)), target_s, max_launches)

    def body(n: int = launches) -> None:
        for _ in range(n):
            once()

    try:
        graph = device.capture(body)
    except Exception as exc:  # not capturable (a library call that allocates or synchronizes)
        log.info("timing %d launches between events: capture failed: %s", launches, exc)
        return _Program(lambda: device.enqueue(body), launches, "events")
    return _Program(lambda: device.replay(graph), launches, "graph")


def _check_measure_args(budget_s: float, warmup_s: float, min_samples: int,
                        max_samples: int) -> None:
    if not (budget_s >= 0 and warmup_s >= 0):
        raise ValueError(f"budget_s and warmup_s must be >= 0, got {budget_s}, {warmup_s}")
    if not 1 <= min_samples <= max_samples:
        raise ValueError(f"need 1 <= min_samples <= max_samples, got {min_samples}, {max_samples}")


def _timed(run: Callable[[], None], clock: Clock) -> float:
    token = clock.start()
    run()
    return max(0.0, float(clock.stop(token)))


def _warm_up(run: Callable[[], None], clock: Clock, warmup_s: float, now: Callable[[], float]) -> int:
    """Run until `warmup_s` of wall time has passed, at least once; returns the run count."""
    began_s = now()
    runs = 0
    while runs == 0 or now() - began_s < warmup_s:
        _timed(run, clock)  # through the clock, so a GPU clock synchronizes
        runs += 1
    return runs


def _sample(run: Callable[[], None], clock: Clock, budget_s: float, min_samples: int,
            max_samples: int, before_each: Callable[[], None] | None, now: Callable[[], float]) -> list[float]:
    """One sample per run, `before_each` untimed before each, until the budget or the cap."""
    began_s = now()
    samples: list[float] = []
    while len(samples) < max_samples:
        if len(samples) >= min_samples and now() - began_s >= budget_s:
            break
        if before_each is not None:
            before_each()
        samples.append(_timed(run, clock))
    return samples


def default_cache_dir() -> Path:
    """`$FUSESEARCH_CACHE` when set (checked by `cache_root`: a folder), else
    `~/.cache/fusesearch/timings`."""
    from costmodels.devices import cache_root

    return cache_root() if os.environ.get(CACHE_ENV) else cache_root() / "timings"


@dataclass(frozen=True)
class TimingCache:
    """Timings by key, one JSON file per key under `root`, written atomically."""

    root: Path = field(default_factory=default_cache_dir)

    @staticmethod
    def key(source_hash: str, shapes: object, device: str, extra: str = "") -> str:
        """sha256 hex of the canonical JSON of (schema, source hash, shapes, device, extra)."""
        doc = {"schema": CACHE_SCHEMA, "source": source_hash, "shapes": shapes,
               "device": device, "extra": extra}
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=_jsonable)
        return hashlib.sha256(text.encode()).hexdigest()

    def path(self, key: str) -> Path:
        if not _KEY_RE.fullmatch(key):
            raise ValueError(f"a timing cache key is 64 lowercase hex digits, got {key!r}; "
                             "build it with TimingCache.key(...)")
        return Path(self.root) / f"{key}.json"

    def get(self, key: str) -> Timing | None:
        """The cached Timing, or None when missing, unreadable, corrupt or for another key."""
        path = self.path(key)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("schema") != CACHE_SCHEMA or data.get("key") != key:
                raise ValueError("schema or key mismatch")
            return Timing.from_dict(data["timing"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("ignoring corrupt timing cache file %s: %s", path, exc)
            return None

    def put(self, key: str, timing: Timing) -> None:
        """Write the file whole or not at all: a tmp file in the same folder, then os.replace."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"schema": CACHE_SCHEMA, "key": key, "timing": timing.to_dict()},
                          sort_keys=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _jsonable(value: object) -> object:
    """Canonical JSON for shape containers: mappings as objects, integer-likes as ints."""
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items()}
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"cannot put {type(value).__name__} in a timing cache key") from None
