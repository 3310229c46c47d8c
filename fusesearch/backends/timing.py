"""Timing of kernels: warm-up, budgeted sampling, robust statistics and an on-disk cache.

Problem: a kernel's run time is noisy (clock boosts, caches, other processes), a single sample
says little, and measuring every kernel of every plan again on each sweep is wasted device time.
Approach: `measure` runs the kernel until `warmup_s` has passed (at least once), then times one
run at a time, with an untimed `before_each` hook (an L2 flush on a GPU) before each sample,
until `budget_s` of wall time is spent — at least `min_samples`, at most `max_samples`. Each run
is bracketed by a `Clock` (`PerfCounterClock` on the host here; `CudaEventClock` in
`fusesearch.backends.cupy`), so a GPU clock's `stop` synchronizes and the wall-time budget is
real. `measure_interleaved` samples several runs in rounds over all of them, so runs compared
with each other (a fused kernel, the kernels it replaces) see the same machine. `Timing` keeps
every sample and reports the median and the 20th/80th percentiles.
`TimingCache` stores one JSON file per key (source hash, input shapes, device, extra).

    warm-up: run, run, ... until warmup_s       (not sampled, no before_each)
    samples: before_each, [start run stop], ... until budget_s and n >= min_samples, or max

Invariants: a `Timing` has at least one sample, every sample >= 0 s; the loop structure depends
only on the arguments and elapsed time (no sleeps), read from `now` (`time.perf_counter`; a test
passes a fake one with a fake `clock`, so the loop's logic is checked without wall time); a cache
file is written whole (tmp file + os.replace) or not at all, and a corrupt or foreign cache file
reads as missing, never a crash.
"""

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
                "n": self.n, "warmup_runs": self.warmup_runs, "clock": self.clock}

    def to_dict(self) -> dict[str, Any]:
        """Everything, samples included (what the cache stores)."""
        return {"samples_s": list(self.samples_s), "warmup_runs": self.warmup_runs,
                "clock": self.clock}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Timing:
        return cls(samples_s=tuple(float(s) for s in data["samples_s"]),
                   warmup_runs=int(data["warmup_runs"]), clock=str(data["clock"]))


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
                        now: Callable[[], float] = time.perf_counter) -> list[Timing]:
    """One Timing per run of `runs`, sampled in `rounds` passes over all of them in order, each
    pass giving every run `budget_s / rounds` of wall time (at least one sample) after one warm-up
    run (the first pass warms up for `warmup_s`). What a shared machine does over minutes (another
    tenant, a frequency change) then falls on every run alike, and runs listed next to each other
    (a fused kernel and the kernels it replaces) are sampled seconds apart, so their ratio holds
    even where each one's absolute time drifts."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    _check_measure_args(budget_s, warmup_s, 1, 1)
    clock = clock if clock is not None else PerfCounterClock()
    samples: list[list[float]] = [[] for _ in runs]
    warmups = [0] * len(runs)
    for r in range(rounds):
        for i, run in enumerate(runs):
            warmups[i] += _warm_up(run, clock, warmup_s if r == 0 else 0.0, now)
            samples[i] += _sample(run, clock, budget_s / rounds, 1, 1000, before_each, now)
    return [Timing(samples_s=tuple(s), warmup_runs=w, clock=clock.name) for s, w in zip(samples, warmups, strict=True)]


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
