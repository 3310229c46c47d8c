"""The GPU timer (`timing.graph_timing`) on a fake device: a fake clock that advances by each
launch's device time, and a fake stream that runs launches or records them into a graph while
capturing. Checked without a GPU: N chosen from the first estimate, per launch = replay / N, the
flush graph taken off, the empty kernel's launch reported apart, the runs interleaved, the
fallback to event-bracketed launches labelled, the CuPy backend's `sample` routed through it; and
(marked gpu) cupy.matmul timed on a real GPU below the host-bound one-launch figure."""

from __future__ import annotations

import math

import pytest

from fusesearch.backends.timing import MAX_LAUNCHES, TARGET_S, Timing, graph_timing, launches_for

KERNEL_S = 10e-6
OTHER_S = 25e-6
FLUSH_S = 40e-6
EMPTY_S = 2e-6


class FakeClock:
    name = "fake_event"

    def __init__(self, device: FakeDevice) -> None:
        self.device = device

    def start(self) -> float:
        return self.device.t

    def stop(self, token: float) -> float:
        return self.device.t - token


class FakeDevice:
    """A stream whose launches advance `t` by their device time when they run, or are recorded
    while a capture is open (`capture`), replayed as recorded (`replay`). `log` lists every
    launch that ran, by tag."""

    def __init__(self) -> None:
        self.t = 0.0
        self.log: list[str] = []
        self.recording: list | None = None
        self.captures = 0

    def now(self) -> float:
        return self.t

    def clock(self) -> FakeClock:
        return FakeClock(self)

    def kernel(self, seconds: float, tag: str, *, capturable: bool = True):
        def launch() -> None:
            if self.recording is None:
                self.t += seconds
                self.log.append(tag)
            elif not capturable:
                raise RuntimeError("operation not permitted when stream is capturing")
            else:
                self.recording.append((seconds, tag))
        return launch

    def enqueue(self, fn) -> None:
        fn()

    def capture(self, fn) -> list:
        self.recording, self.captures = [], self.captures + 1
        try:
            fn()
            return self.recording
        finally:
            self.recording = None

    def replay(self, graph: list) -> None:
        for seconds, tag in graph:
            self.t += seconds
            self.log.append(tag)

    def empty(self) -> None:
        self.kernel(EMPTY_S, "empty")()

    def flush(self) -> None:
        self.kernel(FLUSH_S, "flush")()


def _time(device: FakeDevice, runs, **kw) -> list[Timing]:
    return graph_timing(runs, device, budget_s=0.0, rounds=kw.pop("rounds", 3), warmup_s=0.0, now=device.now, **kw)


def test_launches_are_chosen_so_a_replay_lasts_the_target():
    assert launches_for(KERNEL_S, 1e-3) == 100
    assert launches_for(3e-3, 1e-3) == 1  # a long kernel: one launch per replay
    assert launches_for(0.0, 1e-3, 500) == 500  # an estimate of nothing: the cap
    assert launches_for(KERNEL_S) == min(MAX_LAUNCHES, math.ceil(TARGET_S / KERNEL_S))
    with pytest.raises(ValueError):
        launches_for(KERNEL_S, 1e-3, 0)


def test_a_sample_is_the_replay_over_its_launches_warm():
    device = FakeDevice()
    a, b = _time(device, [device.kernel(KERNEL_S, "a"), device.kernel(OTHER_S, "b")])
    assert (a.launches, b.launches) == (100, 40)  # ceil(1 ms / 10 us), ceil(1 ms / 25 us)
    assert a.samples_s == pytest.approx((KERNEL_S,) * a.n) and b.samples_s == pytest.approx((OTHER_S,) * b.n)
    assert a.timer == b.timer == "graph" and a.cache == b.cache == "warm"
    assert a.clock == "fake_event" and "flush" not in device.log
    # one capture per run and one for the empty kernel; the replays ran N launches each
    assert device.captures == 3
    assert device.log.count("a") == 2 + 100 * (a.warmup_runs + a.n)


def test_the_empty_kernels_launch_is_reported_apart_not_taken_off():
    device = FakeDevice()
    (a,) = _time(device, [device.kernel(KERNEL_S, "a")])
    assert a.launch_s == pytest.approx(EMPTY_S)
    assert a.median_s == pytest.approx(KERNEL_S)  # not KERNEL_S - EMPTY_S
    row = a.to_row()
    assert (row["timer"], row["cache"], row["launches"]) == ("graph", "warm", 100)
    assert row["launch_s"] == pytest.approx(EMPTY_S)


def test_flushed_figures_are_net_of_a_graph_of_as_many_flushes():
    device = FakeDevice()
    a, b = _time(device, [device.kernel(KERNEL_S, "a"), device.kernel(OTHER_S, "b")], flush=True)
    # N from one flush + launch: ceil(1 ms / 50 us), ceil(1 ms / 65 us)
    assert (a.launches, b.launches) == (20, 16)
    assert a.samples_s == pytest.approx((KERNEL_S,) * a.n) and b.samples_s == pytest.approx((OTHER_S,) * b.n)
    assert a.cache == b.cache == "flushed" and a.launch_s == pytest.approx(EMPTY_S)
    # the runs, the empty kernel, and one flush graph per distinct N were captured
    assert device.captures == 2 + 1 + 2
    i = device.log.index("a", 4)  # inside a replay every launch follows a flush
    assert device.log[i - 1] == "flush"


def test_runs_are_replayed_interleaved_round_after_round():
    device = FakeDevice()
    runs = [device.kernel(KERNEL_S, "a"), device.kernel(OTHER_S, "b")]
    _time(device, runs, rounds=3, max_launches=1, target_s=1e-9)  # one launch per replay: the log is the order
    timed = device.log[6:]  # after the two estimate launches of each run and of the empty kernel
    # per round, in order, each run: a warm-up replay then one sampled replay
    assert timed == ["a", "a", "b", "b", "empty", "empty"] * 3


def test_a_run_that_cannot_be_captured_is_timed_between_events_and_says_so():
    device = FakeDevice()
    lib, ours = _time(device, [device.kernel(OTHER_S, "lib", capturable=False), device.kernel(KERNEL_S, "a")])
    assert lib.timer == "events" and ours.timer == "graph"
    assert lib.launches == 40 and lib.samples_s == pytest.approx((OTHER_S,) * lib.n)
    assert lib.to_row()["timer"] == "events"


def test_gpu_fields_survive_the_cache_and_host_rows_have_none():
    device = FakeDevice()
    (a,) = _time(device, [device.kernel(KERNEL_S, "a")], flush=True)
    assert Timing.from_dict(a.to_dict()) == a
    host = Timing((1.0, 2.0), 1, "perf_counter")
    assert set(host.to_row()) == {"median_s", "p20_s", "p80_s", "n", "warmup_runs", "clock"}
    assert Timing.from_dict(host.to_dict()) == host


def test_the_cupy_backend_samples_through_the_graph_timer(monkeypatch):
    from fusesearch.backends import cupy as gpu
    from fusesearch.backends.registry import CPU, CUPY

    device = FakeDevice()
    monkeypatch.setattr(gpu, "graph_timer", lambda: device)
    (a,) = CUPY.sample([device.kernel(KERNEL_S, "a")], budget_s=0.0, rounds=2, warmup_s=0.0, flush=True)
    assert (a.timer, a.cache, a.launches) == ("graph", "flushed", 20)
    assert a.median_s == pytest.approx(KERNEL_S)
    assert CUPY.timing_key() != CPU.timing_key()  # no one-launch GPU sample cached before is reused
    # the host times one run per sample, as before: no timer, no cache state
    (host,) = CPU.sample([lambda: None], budget_s=0.0, rounds=1, warmup_s=0.0)
    assert host.timer == "" and host.clock == "perf_counter"


@pytest.mark.gpu
def test_cupy_matmul_per_launch_from_a_graph_is_below_the_host_bound_figure():
    """128x768x768 through cuBLAS took 32 us per sample timed one launch at a time from Python
    (host-bound); from graph replays it is the GPU's own time."""
    import cupy

    from fusesearch.backends.registry import CUPY

    a = cupy.random.standard_normal((128, 768), dtype=cupy.float32)
    b = cupy.random.standard_normal((768, 768), dtype=cupy.float32)
    state = {}

    def matmul() -> None:
        state["y"] = cupy.matmul(a, b)

    warm, = CUPY.sample([matmul], budget_s=0.05, rounds=2)
    flushed, = CUPY.sample([matmul], budget_s=0.05, rounds=2, flush=True)
    print(f"cupy.matmul 128x768x768: warm {warm.median_s * 1e6:.2f} us ({warm.timer}, N={warm.launches}), "
          f"flushed {flushed.median_s * 1e6:.2f} us ({flushed.timer}), launch {warm.launch_s * 1e6:.2f} us")
    assert warm.cache == "warm" and flushed.cache == "flushed"
    assert warm.timer in ("graph", "events") and warm.launches > 1
    assert 0 < warm.median_s < 20e-6
    assert 0 < warm.launch_s < 10e-6
    cupy.testing.assert_allclose(state["y"], a @ b, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_empty_and_flush_kernels_compile_without_spills(arch):
    from fusesearch.backends import nvrtc
    from fusesearch.backends.cupy import TIMER_SOURCE

    if not nvrtc.toolchain_available():
        pytest.skip("no CUDA compiler (NVRTC or nvcc)")
    result = nvrtc.compile_cuda(TIMER_SOURCE, arch=arch)
    for name in ("fs_empty", "fs_flush"):
        r = result.resource(name)
        assert r.spill_store_bytes == r.spill_load_bytes == 0 and r.smem_bytes == 0
