"""Timing: measure() loop structure and statistics, the on-disk cache, and the CuPy door."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from fusesearch.backends.timing import (
    PerfCounterClock,
    Timing,
    TimingCache,
    default_cache_dir,
    measure,
    measure_interleaved,
)
from fusesearch.errors import FusesearchError

RUN_S = 2.0 ** -9  # a fake run's seconds (about 2 ms), a power of two: sums of them are exact


class FakeTime:
    """Time that moves only when a fake run (or hook) says so: `now` is what the sampling loop
    reads its budget from, and as a Clock it times each run exactly. The loop's logic is then
    checked with exact counts, whatever the machine's speed or load."""

    name = "fake"

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def start(self) -> float:
        return self.t

    def stop(self, token: float) -> float:
        return self.t - token

    def run(self, seconds: float, log: list | None = None, tag: str = ""):
        def go() -> None:
            self.t += seconds
            if log is not None:
                log.append(tag)
        return go


def fake_measure(seconds: float, **kw):
    fake = FakeTime()
    return fake, measure(fake.run(seconds), clock=fake, now=fake.now, **kw)


def nothing() -> None:
    pass


# --- measure -----------------------------------------------------------------------------------


def test_samples_are_the_runs_times_and_the_budget_bounds_the_count():
    """Each sample is one run's time; sampling stops at the first check at or past the budget, so
    the wall time is the warm-up, the budget and at most one run beyond it."""
    fake, t = fake_measure(RUN_S, budget_s=32 * RUN_S, warmup_s=0.0, min_samples=3)
    assert t.clock == "fake" and t.warmup_runs == 1
    assert t.samples_s == (RUN_S,) * 32 and t.n == 32
    assert fake.t == 33 * RUN_S  # one warm-up run, then exactly the budget
    fake, t = fake_measure(RUN_S, budget_s=31.5 * RUN_S, warmup_s=0.0, min_samples=3)
    assert t.n == 32 and fake.t == 33 * RUN_S  # the last sample goes past the budget by part of a run


def test_min_samples_wins_over_an_exhausted_budget():
    _, t = fake_measure(RUN_S, budget_s=0.0, warmup_s=0.0, min_samples=4)
    assert t.samples_s == (RUN_S,) * 4


def test_zero_cost_kernel_stops_at_max_samples():
    """A run that takes no time never spends the budget: the cap ends the loop."""
    _, t = fake_measure(0.0, budget_s=10.0, warmup_s=0.0, min_samples=5, max_samples=50)
    assert t.n == 50 and t.samples_s == (0.0,) * 50


def test_every_sample_is_kept_one_per_timed_run():
    calls: list[str] = []
    t = measure(lambda: calls.append("run"), budget_s=0.0, warmup_s=0.0, min_samples=7,
                before_each=lambda: calls.append("before"))
    assert t.warmup_runs == 1
    assert t.n == 7 and len(t.samples_s) == 7
    assert calls == ["run"] + ["before", "run"] * 7


def test_warm_up_runs_at_least_once_and_is_sized_by_time():
    """Warm-up runs until warmup_s has passed: 6 runs fill 6 runs' time, a half run more takes a
    seventh; no warm-up time still runs once. Warm-up runs are not samples."""
    log: list[str] = []
    fake = FakeTime()
    t = measure(fake.run(RUN_S, log), clock=fake, now=fake.now, budget_s=0.0, warmup_s=6 * RUN_S, min_samples=2)
    assert (t.warmup_runs, t.n, len(log)) == (6, 2, 8)
    assert fake_measure(RUN_S, budget_s=0.0, warmup_s=6.5 * RUN_S, min_samples=1)[1].warmup_runs == 7
    assert fake_measure(RUN_S, budget_s=0.0, warmup_s=0.0, min_samples=1)[1].warmup_runs == 1


def test_before_each_is_not_timed_but_spends_the_budget():
    """A hook before each sample (an L2 flush) is outside the timed run, inside the wall-time budget."""
    fake = FakeTime()
    t = measure(fake.run(RUN_S), clock=fake, now=fake.now, budget_s=12 * RUN_S, warmup_s=0.0, min_samples=1,
                before_each=fake.run(5 * RUN_S))
    assert t.samples_s == (RUN_S, RUN_S)  # 6 runs' wall time per sample: two fill the budget
    assert fake.t == 13 * RUN_S


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="min_samples"):
        measure(nothing, min_samples=10, max_samples=5)
    with pytest.raises(ValueError, match="min_samples"):
        measure(nothing, min_samples=0)
    with pytest.raises(ValueError, match="budget_s"):
        measure(nothing, budget_s=-1.0)


def test_a_custom_clock_is_used_and_named():
    class TickClock:
        name = "ticks"

        def start(self):
            return None

        def stop(self, token):
            return 0.5

    t = measure(nothing, clock=TickClock(), budget_s=0.0, warmup_s=0.0, min_samples=3)
    assert t.samples_s == (0.5, 0.5, 0.5) and t.clock == "ticks"


def test_interleaved_rounds_alternate_the_runs_and_keep_every_sample():
    log = []
    runs = [lambda: log.append("a"), lambda: log.append("b")]
    a, b = measure_interleaved(runs, budget_s=0.0, rounds=3, warmup_s=0.0)
    # each round: a warm-up and one sample of a, then of b
    assert "".join(log) == "aabb" * 3
    assert (a.n, b.n, a.warmup_runs, b.warmup_runs) == (3, 3, 3, 3)


def test_interleaved_timings_measure_each_run_apart():
    """Each run's samples are its own times; each pass gives every run budget_s / rounds."""
    log: list[str] = []
    fake = FakeTime()
    fast, slow = measure_interleaved([fake.run(RUN_S, log, "f"), fake.run(4 * RUN_S, log, "s")], clock=fake,
                                     now=fake.now, budget_s=16 * RUN_S, rounds=2, warmup_s=0.0)
    assert fast.samples_s == (RUN_S,) * 16 and slow.samples_s == (4 * RUN_S,) * 4
    assert (fast.warmup_runs, slow.warmup_runs) == (2, 2)
    assert "".join(log) == ("f" * 9 + "s" * 3) * 2  # a warm-up run and a pass of samples, run by run


def test_interleaved_refuses_no_rounds():
    with pytest.raises(ValueError, match="rounds"):
        measure_interleaved([nothing], rounds=0)


def test_perf_counter_clock_measures_seconds(monkeypatch):
    ticks = iter([1_000, 2_501_000])
    monkeypatch.setattr(time, "perf_counter_ns", lambda: next(ticks))
    clock = PerfCounterClock()
    assert clock.stop(clock.start()) == pytest.approx(2.5e-3, rel=1e-12)


# --- Timing ------------------------------------------------------------------------------------


def test_percentiles_are_ordered_and_linear():
    t = Timing(samples_s=(5.0, 1.0, 3.0, 2.0, 4.0), warmup_runs=2, clock="perf_counter")
    assert t.p20_s <= t.median_s <= t.p80_s
    assert (t.p20_s, t.median_s, t.p80_s) == pytest.approx((1.8, 3.0, 4.2))
    times = iter(t * RUN_S for t in (3, 1, 4, 1, 5, 9, 2, 6, 5, 3))  # a warm-up run, then nine samples
    fake = FakeTime()
    measured = measure(lambda: setattr(fake, "t", fake.t + next(times)), clock=fake, now=fake.now, budget_s=0.0,
                       warmup_s=0.0, min_samples=9)
    assert measured.samples_s == tuple(t * RUN_S for t in (1, 4, 1, 5, 9, 2, 6, 5, 3))
    assert (measured.p20_s, measured.median_s, measured.p80_s) == pytest.approx((1.6 * RUN_S, 4 * RUN_S, 5.4 * RUN_S))


def test_to_row_keys_and_values():
    t = Timing(samples_s=(1.0, 2.0, 3.0), warmup_runs=4, clock="cuda_event")
    row = t.to_row()
    assert set(row) == {"median_s", "p20_s", "p80_s", "n", "warmup_runs", "clock"}
    assert row["median_s"] == 2.0 and row["n"] == 3 and row["warmup_runs"] == 4
    assert row["clock"] == "cuda_event"
    json.dumps(row)


def test_timing_refuses_empty_or_negative_samples():
    with pytest.raises(ValueError):
        Timing(samples_s=(), warmup_runs=0, clock="perf_counter")
    with pytest.raises(ValueError):
        Timing(samples_s=(-1.0,), warmup_runs=0, clock="perf_counter")


# --- TimingCache -------------------------------------------------------------------------------


TIMING = Timing(samples_s=(1e-5, 2e-5, 3e-5), warmup_runs=3, clock="perf_counter")


def test_cache_round_trips(tmp_path):
    cache = TimingCache(tmp_path / "timings")
    key = cache.key("abc", [(1, 3, 224, 224)], "h100-sxm")
    assert cache.get(key) is None
    cache.put(key, TIMING)
    assert cache.get(key) == TIMING
    assert TimingCache(tmp_path / "timings").get(key) == TIMING


def test_keys_differ_by_hash_shapes_device_and_extra():
    base = TimingCache.key("abc", {"x": (1, 8)}, "h100-sxm")
    assert len(base) == 64 and int(base, 16) >= 0
    others = {TimingCache.key("abd", {"x": (1, 8)}, "h100-sxm"),
              TimingCache.key("abc", {"x": (1, 9)}, "h100-sxm"),
              TimingCache.key("abc", {"x": (1, 8)}, "a100-80"),
              TimingCache.key("abc", {"x": (1, 8)}, "h100-sxm", extra="-O3")}
    assert base not in others and len(others) == 4


def test_keys_are_canonical():
    import numpy as np

    a = TimingCache.key("abc", {"x": (1, 8), "y": [2]}, "t4")
    b = TimingCache.key("abc", {"y": (np.int64(2),), "x": [1, 8]}, "t4")
    assert a == b


def test_corrupt_or_foreign_files_read_as_missing(tmp_path):
    cache = TimingCache(tmp_path)
    key = cache.key("abc", [], "cpu")
    for text in ("{not json", "[]", '{"schema": "fusesearch.timing/1"}',
                 json.dumps({"schema": "fusesearch.timing/1", "key": key,
                             "timing": {"samples_s": [], "warmup_runs": 0, "clock": "x"}})):
        cache.path(key).write_text(text)
        assert cache.get(key) is None
    other = cache.key("abd", [], "cpu")
    cache.put(other, TIMING)
    cache.path(key).write_bytes(cache.path(other).read_bytes())  # a file under the wrong name
    assert cache.get(key) is None
    cache.put(key, TIMING)  # a corrupt file is overwritten by the next put
    assert cache.get(key) == TIMING


def test_writes_are_atomic(tmp_path, monkeypatch):
    cache = TimingCache(tmp_path)
    key = cache.key("abc", [], "cpu")
    cache.put(key, TIMING)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{key}.json"]

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    newer = Timing(samples_s=(9.0,), warmup_runs=1, clock="perf_counter")
    with pytest.raises(OSError, match="disk full"):
        cache.put(key, newer)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{key}.json"]
    assert cache.get(key) == TIMING


def test_bad_keys_are_refused(tmp_path):
    with pytest.raises(ValueError, match="64 lowercase hex"):
        TimingCache(tmp_path).get("../../etc/passwd")


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSESEARCH_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    assert TimingCache().root == tmp_path
    monkeypatch.delenv("FUSESEARCH_CACHE")
    assert default_cache_dir().parts[-3:] == (".cache", "fusesearch", "timings")


# --- the CuPy door -----------------------------------------------------------------------------


def test_cupy_module_imports_without_cupy():
    code = ("import sys; sys.modules['cupy'] = None; import fusesearch.backends.cupy as m; "
            "assert m.CudaEventClock.name == 'cuda_event'; "
            "assert not m.available().ok and m.gpu_count() == 0; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_importing_the_cupy_backend_does_not_import_cupy():
    code = ("import sys, fusesearch.backends.cupy; print('cupy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_no_cupy_means_a_refusal_with_a_reason(monkeypatch):
    from fusesearch.backends import cupy as cupy_backend

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    decision = cupy_backend.available()
    assert not decision.ok and "pip install 'fusesearch[gpu]'" in decision.reason
    assert cupy_backend.gpu_count() == 0
    with pytest.raises(FusesearchError, match="fusesearch\\[gpu\\]"):
        cupy_backend.compile_module("__global__ void k() {}")


def test_this_machine_refuses_or_accepts_consistently():
    from fusesearch.backends import cupy as cupy_backend

    decision = cupy_backend.available()
    assert bool(decision) == (cupy_backend.gpu_count() > 0)
    if not decision.ok:
        assert decision.reason.startswith(("cupy is not installed", "no CUDA device",
                                           "cupy failed to import"))


ADD_ONE = r"""
extern "C" __global__ void add_one(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
"""


@pytest.mark.gpu
def test_cuda_event_clock_times_a_tiny_kernel():
    import cupy as cp

    from fusesearch.backends.cupy import CudaEventClock, compile_module, l2_flusher

    n = 1 << 20
    x = cp.zeros(n, dtype=cp.float32)
    kernel = compile_module(ADD_ONE).get_function("add_one")
    l2_bytes = int(cp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"])

    def run() -> None:
        kernel(((n + 255) // 256,), (256,), (x, cp.int32(n)))

    t = measure(run, clock=CudaEventClock(), budget_s=0.05, warmup_s=0.01, min_samples=5,
                before_each=l2_flusher(l2_bytes))
    assert t.clock == "cuda_event" and t.n >= 5
    assert t.median_s > 0  # how fast is for benchmarks/, not a test
    assert t.p20_s <= t.median_s <= t.p80_s
    assert float(x[0]) == t.warmup_runs + t.n
